"""Drive the dashboard page in a real, headless Chromium (Debian's ``chromium`` through Playwright):
used by the browser test and by ``scripts/check_dashboard.py``. Needs the ``test`` extra.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator

CHROMIUM = os.environ.get("P2P_DILOCO_CHROMIUM", "/usr/bin/chromium")
# flags for a machine without internet: no background connections, no sandbox (root in CI)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]

# pixels of a colour (within a tolerance, for antialiasing) on a chart's canvas
_COUNT_COLOR = """([id, rgb]) => {
  const c = document.querySelector(`#${id} canvas`);
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 200 && Math.abs(d[i] - rgb[0]) < 30 && Math.abs(d[i + 1] - rgb[1]) < 30
        && Math.abs(d[i + 2] - rgb[2]) < 30) n++;
  }
  return n;
}"""
ROWS = "[...document.querySelectorAll('#islands tbody tr')].map(r => [r.dataset.island, r.className])"
STEPS = ("Object.fromEntries(window.dashboard.status.islands.filter(i => !i.departed)"
         ".map(i => [i.key, i.inner_step]))")
SPEED_COLOR = "#1f77b4"  # the tokens/s line (static/dashboard.js)


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator:
    """A new Playwright page in headless Chromium; the browser is closed on exit.

    :raises FileNotFoundError: Chromium is not at ``P2P_DILOCO_CHROMIUM`` (default /usr/bin/chromium)
    """
    from playwright.sync_api import sync_playwright

    if not os.access(CHROMIUM, os.X_OK):
        raise FileNotFoundError(f"{CHROMIUM} is missing: run scripts/setup_chromium.sh (Debian's chromium) "
                                "or set P2P_DILOCO_CHROMIUM")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def color_pixels(page, chart: str, color: str) -> int:
    """Pixels of ``color`` (``#rrggbb``) drawn on the canvas of ``#chart-<chart>`` (``loss`` or ``speed``)."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return page.evaluate(_COUNT_COLOR, [f"chart-{chart}", rgb])


def island_color(page, key: str) -> str:
    """The colour the page gave island ``key`` (``#rrggbb``)."""
    return page.evaluate("(key) => window.dashboard.colors[key]", key)


def rows(page) -> list[list[str]]:
    """[island, row class ("" or "departed")] of each row of the islands table, in page order."""
    return page.evaluate(ROWS)


def wait_for_new_steps(page, timeout_ms: float = 30_000) -> None:
    """Wait until every live island shown has a larger inner step than now, without a reload."""
    page.wait_for_function(f"(() => {{ const b = {json.dumps(page.evaluate(STEPS))}; const s = {STEPS}; "
                           "return Object.keys(b).every(k => s[k] > b[k]); })()", timeout=timeout_ms)
