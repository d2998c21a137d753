"""The report in a real browser: headless Chromium draws every plot and logs nothing.

Each plot is shown on its own page (the report's own markup and CSS) and
screenshotted; its pixels must hold drawn data (coloured marks, not only axes
and text). The whole report is loaded too: the browser console must stay
silent (a blocked fetch, a CSP violation or a script error would be logged).
Needs the ``chromium`` binary (``scripts/setup.sh`` installs it; ``$CHROMIUM``
overrides); skips, saying so, without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from matplotlib import image

from ckpt_agent.report import load_run, plot_all, run_page, run_summary
from ckpt_agent.storage.fs import LocalStorage

CHROMIUM = os.environ.get("CHROMIUM") or next(
    (p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="chromium not found ($CHROMIUM or PATH; scripts/setup.sh installs it): "
        "the report is not checked in a browser",
    ),
]
CONSOLE = re.compile(r":CONSOLE[:(\]]")


def _shoot(page: Path, png: Path, size: str = "1100,420") -> str:
    """Screenshot ``page``; returns the browser's log (console messages included)."""
    assert CHROMIUM is not None
    res = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-extensions",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={png.parent / 'profile'}",
            f"--window-size={size}",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0 and png.exists(), res.stderr[-2000:]
    return res.stderr


def _coloured_share(png: Path) -> tuple[float, float]:
    """(share of non-white pixels, share of saturated pixels) of a screenshot."""
    px: Any = image.imread(str(png))[..., :3]
    ink = (px.min(axis=2) < 0.9).mean()
    saturated = ((px.max(axis=2) - px.min(axis=2)) > 0.25).mean()
    return float(ink), float(saturated)


def test_the_console_check_sees_messages(tmp_path: Path) -> None:
    """Control: the log check catches a page that does write to the console."""
    page = tmp_path / "noisy.html"
    page.write_text('<html><body><script>console.error("boom")</script>x</body></html>')
    assert CONSOLE.search(_shoot(page, tmp_path / "noisy.png"))


def test_every_plot_draws_and_the_console_stays_silent(rp_run: Any, tmp_path: Path) -> None:
    data = load_run(LocalStorage(rp_run.store), rp_run.run_id, rp_run.work)
    s = run_summary(rp_run.run_id, data.records, data.events, data.audit)
    svgs = plot_all(s)
    page = run_page(s, svgs)
    report = tmp_path / "report.html"
    report.write_text(page)
    log = _shoot(report, tmp_path / "report.png", "1200,5000")
    assert not CONSOLE.search(log), [line for line in log.splitlines() if CONSOLE.search(line)]
    assert _coloured_share(tmp_path / "report.png")[1] > 0.01
    head = page[: page.index("<body>") + len("<body>")]
    for name, svg in svgs.items():
        one = tmp_path / f"{name}.html"
        one.write_text(f'{head}<div class="plot" id="plot-{name}">{svg}</div></body></html>')
        png = tmp_path / f"{name}.png"
        assert not CONSOLE.search(_shoot(one, png))
        ink, coloured = _coloured_share(png)
        assert ink > 0.02 and coloured > 0.0015, (name, ink, coloured)
    # control: a plot without data (axes and a note only) has no coloured marks
    empty = dict(
        s, series={"loss": [], "score": [], "interval": [], "interval_changes": []}, saves=[]
    )
    blank = tmp_path / "blank.html"
    blank.write_text(f"{head}{plot_all(empty)['score']}</body></html>")
    _shoot(blank, tmp_path / "blank.png")
    assert _coloured_share(tmp_path / "blank.png")[1] < 0.0005
