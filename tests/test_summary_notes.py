"""conftest.py's ``summary_notes``: lines for the CI log, printed by the controller under xdist.

(The image's size and how the e2e ran the operator were lost under ``pytest -n 2``: a
worker's output never reaches the terminal.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["in-process", "xdist"])
def test_notes_reach_the_terminal_summary(tmp_path: Path, workers: list[str]) -> None:
    (tmp_path / "conftest.py").write_bytes((ROOT / "conftest.py").read_bytes())
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_notes.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture(scope='session')\n"
        "def started(summary_notes):\n"
        "    yield\n"
        "    summary_notes.append('[x] noted at session teardown')\n\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_note(summary_notes, started, i):\n"
        "    summary_notes.append('[x] the same note from every worker')\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines.count("[x] the same note from every worker") == 1, res.stdout
    assert "[x] noted at session teardown" in lines, res.stdout
