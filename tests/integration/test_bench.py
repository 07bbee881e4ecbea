"""Smoke tests of the side-by-side benchmarks (scripts/bench/compare.py and wan.py) with a tiny
budget: each writes a complete table, every arm present with finite figures. No speed is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from p2p_diloco.lab import netns
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

TINY = ["--learners", "2", "--steps", "12", "--h", "4", "--eval-every-steps", "6", "--eval-batches", "2",
        "--eval-seconds", "5", "--ours-period", "12"]


def _left_running(folder) -> list[str]:
    """Command lines of live processes that name ``folder`` (every process of an arm does)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(folder) in cmdline:
                found.append(cmdline)
    return found


def _finite(row: dict, keys) -> None:
    for key in keys:
        value = row.get(key)
        assert isinstance(value, (int, float)) and math.isfinite(value), (row["arm"], key, value)


def _run(script: str, out, *args: str, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / script), *TINY, *args, "--out", str(out)],
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


# every arm's clean pass; the failure passes (a learner SIGKILLed halfway, and restarted where the arm
# can) are left to the full runs (docs/BENCHMARKS.md): their figures are unit-tested
# (tests/unit/test_benchmark.py) and ours's downtime and stalls under kills are the chaos test's
ARMS = ["ddp", "hivemind", "torchft", "ours"]


@pytest.mark.timeout(600)
def test_compare_writes_every_arm_with_finite_figures(tmp_path):
    result = _run("compare.py", tmp_path, "--arms", *ARMS, "--no-failure", timeout=580)
    rows = json.loads((tmp_path / "results.json").read_text())["table"]
    assert [row["arm"] for row in rows] == ARMS
    for row in rows:
        _finite(row, ["eval_loss", "eval_loss_mean_model", "wall_seconds", "tokens_per_second", "utilization",
                      "bytes_per_token"])
        assert "eval_loss_failure" not in row
        assert row["tokens"] >= 2 * 12 * 2048  # the whole budget
        assert 0 < row["utilization"] <= 1.0
        assert len(row["curve"]) >= 2
    ddp = rows[0]
    # a ring all-reduce of fp32 gradients every step: 2 (n - 1) / n x 4 bytes per parameter, 2048 tokens a step
    parameters = json.loads(next((tmp_path / "clean" / "ddp").glob("*.summary.json")).read_text())["parameters"]
    assert ddp["bytes_per_token"] == pytest.approx(2 * (2 - 1) / 2 * 4 * parameters / 2048, rel=0.01)
    assert ddp["fewer_bytes_than_ddp"] == 1.0
    # DDP's learners hold the same parameters: the mean model is each of them
    assert ddp["eval_loss_mean_model"] == pytest.approx(ddp["eval_loss"], abs=2e-3)
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {arm} |" in table for arm in ARMS)
    assert (tmp_path / "compare.png").stat().st_size > 10_000 and "plot:" in result.stdout
    assert not _left_running(tmp_path)  # every learner, torchrun worker, DHT and lighthouse has ended
    assert json.loads((tmp_path / "results.json").read_text())["failure"] == []


@pytest.mark.timeout(300)
@pytest.mark.skipif(netns.check_available() is not None, reason=f"network namespaces: {netns.check_available()}")
def test_wan_runs_ddp_and_ours_over_throttled_links(tmp_path):
    _run("wan.py", tmp_path, "--rate", "50mbit", "--arms", "ours", timeout=280)  # (DDP over netns: full runs)
    rows = json.loads((tmp_path / "results.json").read_text())["table"]
    assert [row["arm"] for row in rows] == ["ours"]
    for row in rows:
        _finite(row, ["eval_loss", "eval_loss_mean_model", "wall_seconds", "tokens_per_second", "utilization",
                      "bytes_per_token"])
    assert "| ours |" in (tmp_path / "table.md").read_text()
    assert not _left_running(tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script,flags", [("compare.py", ["--learners", "1"]),
                                          ("compare.py", ["--arms", "ours", "ours"]),
                                          ("compare.py", ["--arms", "ours", "--failure-arms", "ddp"]),
                                          ("wan.py", ["--timeout", "0"])])
def test_bad_flags_exit_2_with_a_message(script, flags, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / script), *flags, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert result.returncode == 2 and "error:" in result.stderr and "Traceback" not in result.stderr
