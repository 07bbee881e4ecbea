"""scripts/bench/allreduce.py as a smoke run: a tiny cell, a complete table and JSON, nothing left running.

No speed figure is asserted: the machine may be busy.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "scripts" / "bench" / "allreduce.py"


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(180)
def test_tiny_benchmark_writes_every_cell(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes-mb", "0.25", "--peers", "2", "--repeats", "1",
         "--matchmaking-time", "0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["repeats"] == 1
    cells = {(cell["size_mb"], cell["peers"]): cell for cell in results["cells"]}
    assert sorted(cells) == [(0.25, 2)]
    cell = cells[(0.25, 2)]
    assert cell["bytes"] == 2**18 and cell["elements"] == 2**16
    for kind in ("ours", "gloo", "copy"):
        assert _positive(cell[kind]["round_s"]["median"]) and _positive(cell[kind]["round_s"]["min"]), kind
    assert _positive(cell["ours"]["allreduce_s"]["median"])
    assert len(cell["ours"]["rounds"]) == 1 and len(cell["ours"]["rounds"][0]["per_rank"]) == 2
    assert len(cell["gloo"]["rounds"]) == 1 and len(cell["gloo"]["rounds"][0]["per_rank"]) == 2
    for name in ("ours_over_gloo", "ours_allreduce_over_gloo", "ours_over_copy", "ours_allreduce_over_copy"):
        assert _positive(cell["ratios"][name]), name

    table = (out / "table.md").read_text()
    assert "| size MB | peers | ours s |" in table
    rows = [line for line in table.splitlines() if line.startswith("| 0.25 | 2 |")]
    assert len(rows) == 1 and "n/a" not in rows[0], table
    assert rows[0] in done.stdout  # the printed table is the written one


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [["--peers", "1"], ["--sizes-mb", "0"], ["--repeats", "0"]])
def test_bad_flags_exit_2_without_traceback(flags):
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert done.returncode == 2
    assert "error:" in done.stderr and "Traceback" not in done.stderr
