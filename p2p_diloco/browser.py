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
# the colour of each island's series (static/dashboard.js, PALETTE), as RGB
PALETTE = [(0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28), (0x2C, 0xA0, 0x2C), (0xFF, 0x7F, 0x0E), (0x94, 0x67, 0xBD)]

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
STEPS = "Object.fromEntries(window.dashboard.status.islands.map(i => [i.island, i.inner_step]))"


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


def color_pixels(page, chart: str, rgb) -> int:
    """Pixels of colour ``rgb`` drawn on the canvas of ``#chart-<chart>`` (``loss`` or ``speed``)."""
    return page.evaluate(_COUNT_COLOR, [f"chart-{chart}", list(rgb)])


def rows(page) -> list[list[str]]:
    """[island, row class ("" or "departed")] of each row of the islands table, in page order."""
    return page.evaluate(ROWS)


def wait_for_new_steps(page, timeout_ms: float = 30_000) -> None:
    """Wait until every island shown has a larger inner step than now, without a reload."""
    page.wait_for_function(f"(() => {{ const b = {json.dumps(page.evaluate(STEPS))}; const s = {STEPS}; "
                           "return Object.keys(b).every(k => s[k] > b[k]); })()", timeout=timeout_ms)
