"""./scripts/demo.sh as a short smoke run: a real local swarm, its outputs, and nothing left running."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_demo_short_run(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh"), "--islands", "2", "--minutes", "0.6", "--period", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "per-island summary" in done.stdout
    summaries = json.loads((out / "summaries.json").read_text())
    assert sorted(summaries) == ["island-0", "island-1"]
    for summary in summaries.values():
        assert summary["eval_loss_last"] < summary["eval_loss_first"]
        assert summary["outer_rounds_ok"] >= 1 and "2" in summary["group_sizes"]
    history = [json.loads(line) for line in (out / "status_history.jsonl").read_text().splitlines()]
    assert max(snapshot["totals"]["islands"] for snapshot in history) == 2
    png = (out / "loss_vs_tokens.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
