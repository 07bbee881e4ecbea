"""Shared fixtures: a per-session tokenizer cache, and no process outliving its test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from p2p_diloco.procs import children, descendants, pid_alive

ROOT = Path(__file__).resolve().parents[1]
# PIDs that a test started for a module fixture, which ends them (a restarted bootstrap node)
KEPT: set[int] = set()


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """Tokenizers and token arrays are cached once per session (or where P2P_DILOCO_CACHE points)."""
    if not os.environ.get("P2P_DILOCO_CACHE"):
        os.environ["P2P_DILOCO_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield os.environ["P2P_DILOCO_CACHE"]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Kill, by PID, any process a test started (directly or not) that is still alive after it.

    Processes started by module fixtures before the test, those in ``KEPT``, and their descendants,
    are left alone.
    """
    before = set(children(os.getpid()))
    yield
    deadline = time.monotonic() + 10
    started = set(children(os.getpid())) - before - KEPT
    leftovers = [pid for child in started for pid in [child, *descendants(child)]]
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.2)
        leftovers = [pid for pid in leftovers if pid_alive(pid)]
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
