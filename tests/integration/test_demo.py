"""./scripts/demo.sh as a short smoke run: a real local swarm, its outputs, and nothing left running."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import pytest

from tests.conftest import ROOT
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.integration


def _dashboard_url(stderr_path) -> str | None:
    found = re.search(r"dashboard: (http://\S+/)", stderr_path.read_text(errors="replace"))
    return found.group(1) if found else None


def _live_islands(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "api/status", timeout=10) as response:
            return json.loads(response.read())["totals"]["islands_alive"]
    except OSError:  # refused or slow on a loaded machine: ask again
        return 0


def _running(demo: subprocess.Popen, value):
    assert demo.poll() is None, f"the demo ended early (exit code {demo.returncode})"
    return value


def test_demo_short_run(tmp_path):
    out = tmp_path / "run"
    stdout_path, stderr_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        demo = subprocess.Popen(
            [str(ROOT / "scripts" / "demo.sh"), "--islands", "2", "--minutes", "0.3", "--period", "8", "--out", str(out),
             "--dashboard-port", "0"], stdout=stdout, stderr=stderr, text=True,
        )
    try:
        # the demo serves the dashboard and prints its URL; the page's JSON lists both islands
        url = wait_for(lambda: _running(demo, _dashboard_url(stderr_path)), timeout=200,
                       message="the demo's dashboard URL")
        wait_for(lambda: _running(demo, _live_islands(url) == 2), timeout=120, message="2 islands on the dashboard")
        demo.wait(400)
    finally:
        if demo.poll() is None:
            demo.kill()
    output = stdout_path.read_text() + stderr_path.read_text()
    assert demo.returncode == 0, output[-6000:]
    assert "per-island summary" in stdout_path.read_text()
    summaries = json.loads((out / "summaries.json").read_text())
    assert sorted(summaries) == ["island-0", "island-1"]
    for summary in summaries.values():
        assert summary["eval_loss_last"] < summary["eval_loss_first"]
        assert summary["outer_rounds_ok"] >= 1 and "2" in summary["group_sizes"]
    history = [json.loads(line) for line in (out / "status_history.jsonl").read_text().splitlines()]
    assert max(snapshot["totals"]["islands"] for snapshot in history) == 2
    png = (out / "loss_vs_tokens.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
