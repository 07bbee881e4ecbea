#!/usr/bin/env python3
"""Check the dashboard of a running demo in a real browser, as a user would, and print the figures.

Starts ``./scripts/demo.sh`` (3 islands), opens the printed URL in headless Chromium, waits until
the 3 islands train, checks that every island's row and curve and the tokens/s chart are drawn,
measures how old the newest record is when the page shows it, SIGKILLs island-2 and times how long
the page takes to show it as departed, and parses ``/metrics`` with prometheus-client's own parser
before and after. Writes screenshots and ``check.json`` to ``--out``. Needs the ``test`` extra and
Chromium (``scripts/setup_chromium.sh``). Run: ``.venv/bin/python scripts/check_dashboard.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/browser.py
from tests import browser  # noqa: E402
from p2p_diloco.procs import descendants
from p2p_diloco import files

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ("window.dashboard && window.dashboard.status && window.dashboard.status.islands"
            ".filter(i => i.state == 'training' && i.inner_step > 0).length == 3")
AGE = ("Date.now() / 1000 - Math.max(...window.dashboard.status.islands.filter(i => !i.departed)"
       ".map(i => i.time))")


def island_up(url: str) -> dict[str, float]:
    """``p2p_diloco_island_up`` per island, read from ``/metrics`` with prometheus-client's parser."""
    with urllib.request.urlopen(url + "metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    return {s.labels["island"]: s.value for s in families["p2p_diloco_island_up"].samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/check-dashboard", help="folder for screenshots, logs and check.json")
    parser.add_argument("--minutes", type=float, default=2.0, help="the demo's training minutes (default: 2)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo.stdout", "w") as stdout, open(out / "demo.stderr", "w") as stderr:
        demo = subprocess.Popen([str(ROOT / "scripts" / "demo.sh"), "--minutes", str(args.minutes), "--out",
                                 str(out / "run")], stdout=stdout, stderr=stderr, cwd=ROOT)
    result: dict = {}
    try:
        deadline = time.monotonic() + 600
        while not (found := re.search(r"dashboard: (http://\S+/)", (out / "demo.stderr").read_text())):
            if demo.poll() is not None or time.monotonic() > deadline:
                print(f"error: the demo printed no dashboard URL; see {out}/demo.stderr", file=sys.stderr)
                return 1
            time.sleep(0.5)
        url = result["url"] = found.group(1)
        with browser.chromium() as page:
            page.goto(url)
            page.wait_for_function(TRAINING, timeout=300_000)
            time.sleep(20)  # some history for the charts
            result["rows"] = browser.rows(page)
            result["loss_curve_pixels"] = {
                name: browser.color_pixels(page, "loss", browser.island_color(page, name))
                for name in ("island-0", "island-1", "island-2")}
            result["speed_chart_pixels"] = browser.color_pixels(page, "speed", browser.SPEED_COLOR)
            ages, last, end = [], None, time.monotonic() + 20
            while time.monotonic() < end:  # the newest record's age each time the page redraws
                if (updates := page.evaluate("window.dashboard.updates")) != last:
                    last = updates
                    ages.append(page.evaluate(AGE))
                time.sleep(0.1)
            result["record_age_when_shown_s"] = {"median": round(statistics.median(ages), 2),
                                                 "max": round(max(ages), 2), "redraws": len(ages)}
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            result["island_up_before_kill"] = island_up(url)
            victim = next(pid for pid in descendants(demo.pid)
                          if b"--island\0island-2\0" in Path(f"/proc/{pid}/cmdline").read_bytes())
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            page.wait_for_function("[...document.querySelectorAll('#islands tbody tr.departed')]"
                                   ".some(r => r.dataset.island == 'island-2')", timeout=60_000)
            result["departed_shown_after_kill_s"] = round(time.monotonic() - killed, 1)
            page.screenshot(path=str(out / "dashboard_departed.png"), full_page=True)
            result["island_up_after_kill"] = island_up(url)
        demo.wait(600)
        result["demo_exit_code"] = demo.returncode  # 1: island-2 did not finish (it was killed)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(120)
            except subprocess.TimeoutExpired:
                demo.kill()  # the demo's own children end with it (exit-with-parent)
    files.write_json(out / "check.json", result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
