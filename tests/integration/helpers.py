"""Helpers for tests that run real swarms on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from p2p_diloco.island.events import read_events

# fast rounds for a 2-core machine: fragment p of 2 syncs every 8 s, one fragment every 4 s
FAST = [
    "--preset", "tiny", "--device", "cpu", "--threads", "1",
    "--outer-period", "8", "--outer-matchmaking-time", "1.5", "--outer-grace-window", "0.5",
    "--outer-allreduce-timeout", "1.5", "--outer-request-timeout", "0.5",
    "--progress-period", "1", "--progress-ttl", "6", "--eval-every", "20", "--eval-batches", "2",
    "--inner-warmup-steps", "10", "--join-timeout", "30",
]
# islands on a device half as fast (the lab's --slowdown: each inner step is followed by a pause as
# long as its compute), for tests bounded in rounds. Each island of a real swarm has a machine of its
# own; on 2 shared cores, islands that compute flat out starve every process started after them (a
# late joiner's start-up took 3-5x longer than alone, the test's own status calls too), and half a
# core each leaves the others the headroom their own machines would give them. Islands started with
# it run under the lab's entry point (p2p_diloco.lab.faults), which is the product's island with a
# slower learner
PACED = ["--slowdown", "2"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m p2p_diloco ARGS`` and capture its output."""
    return subprocess.run([sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True,
                          timeout=timeout)


def cli_in_background(*args: str, timeout: float = 120):
    """Start ``python -m p2p_diloco ARGS`` now; returns a function that waits for it (up to
    ``timeout`` s from now) and gives its CompletedProcess, so that a test overlaps it with a wait."""
    command = [sys.executable, "-m", "p2p_diloco", *args]
    popen = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout

    def done() -> subprocess.CompletedProcess:
        try:
            out, err = popen.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            out, err = popen.communicate()
        return subprocess.CompletedProcess(command, popen.returncode, out, err)

    return done


def assert_clean_error(done: subprocess.CompletedProcess, code: int, needle: str) -> None:
    """The command failed with exit ``code`` and one ``error:`` line naming ``needle``, no traceback."""
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], done.stderr[-2000:]


def status_json(initial_peers, run_id: str, *extra: str) -> dict:
    done = cli("status", "--initial-peers", *initial_peers, "--run-id", run_id, "--json", "--join-timeout", "15",
               *extra, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for(predicate, timeout: float, interval: float = 0.5, message: str = ""):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {message or predicate}")
        time.sleep(interval)


def events_of(path: Path, kind: str | None = None) -> list[dict]:
    if not Path(path).exists():
        return []
    events = read_events(str(path))
    return [e for e in events if kind is None or e.get("event") == kind]


def rounds_by_slot(event_paths: dict[str, Path]) -> dict[tuple[int, int], dict[str, dict]]:
    """{(fragment, slot): {island: round event}} over several islands' logs."""
    table: dict[tuple[int, int], dict[str, dict]] = defaultdict(dict)
    for name, path in event_paths.items():
        for event in events_of(path, "round"):
            table[(event["fragment"], event["slot"])][name] = event
    return table


def max_step_gap(steps: list[dict], start: float, end: float) -> float:
    """Largest time between the end of one inner step and the start of the next, within [start, end]."""
    window = [s for s in steps if start <= s["t"] <= end]
    gaps = [(b["t"] - b["dt"]) - a["t"] for a, b in zip(window, window[1:])]
    return max(gaps, default=0.0)
