"""``ckpt sidecar`` logs through ``text.CleanFormatter`` (issue #28): its lines quote stored
checkpoint ids, names and errors, and whoever can write the store chooses those bytes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.text import CleanFormatter

EVIL = "pulse_step_1\x1b[31m\x1b]0;pwned\x07\u202eevil\nERROR forged line"


@pytest.fixture
def bare_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The root logger as in a fresh process (no handler: ``basicConfig`` configures it)."""
    for var in list(os.environ):
        if var.startswith("CKPT_"):
            monkeypatch.delenv(var)
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])
    yield root
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]


def test_the_sidecars_log_lines_are_clean(bare_root: logging.Logger) -> None:
    bare_root.handlers[:] = []  # pytest's capture handlers are added after fixtures ran
    res = CliRunner().invoke(app, ["sidecar"])  # no shared-memory directory: exit 2
    handlers = bare_root.handlers[:]
    bare_root.handlers[:] = []
    assert res.exit_code == 2
    assert len(handlers) == 1 and isinstance(handlers[0].formatter, CleanFormatter)
    record = logging.LogRecord(
        "ckpt_agent.flash", logging.ERROR, __file__, 1, "persisting %s failed", (EVIL,), None
    )
    line = handlers[0].format(record)
    assert "ckpt-sidecar ERROR persisting pulse_step_1\\x1b[31m\\x1b]0;pwned\\x07" in line
    assert [c for c in ("\x1b", "\x07", "\u202e", "\n") if c in line] == [], line
