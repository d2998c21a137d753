"""The operator's log lines go out through ``text.CleanFilter`` on kopf's handler (issue #28):
a record quoting a stored name with terminal escapes, a bidi override or a newline is one
line of visible escapes, in plain and in JSON format, its traceback lines too."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from ckpt_agent.text import CleanFilter
from ckpt_operator.app.main import configure_logging
from ckpt_operator.model.config import parse_config

EVIL = "team-b\x1b[31m\x1b]0;pwned\x07\u202eevil\nWARNING forged line"
RAW = ("\x1b", "\x07", "\u202e")


@pytest.fixture
def root_handlers() -> Iterator[None]:
    root = logging.getLogger()
    objects = logging.getLogger("kopf.objects")
    saved = (root.level, root.handlers[:], objects.level)
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    objects.setLevel(saved[2])


def _kopf_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger().handlers if type(h).__module__.startswith("kopf")]


@pytest.mark.usefixtures("root_handlers")
@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_kopfs_handler_shows_stored_text_escaped(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(2):  # configured twice: one filter
        configure_logging(parse_config(["--webhook=false", f"--log-format={fmt}"], {}))
        handlers = _kopf_handlers()
        assert handlers and all(
            sum(isinstance(f, CleanFilter) for f in h.filters) == 1 for h in handlers
        )
    capsys.readouterr()
    log = logging.getLogger("ckpt_operator.test")
    log.warning("run owned by %s", EVIL)
    try:
        raise ValueError(EVIL)
    except ValueError:
        log.exception("reconcile of %s failed", "ns/name")
    text = capsys.readouterr().err
    assert [c for c in RAW if c in text] == [], text
    lines = text.splitlines()
    if fmt == "json":
        lines = [json.loads(line)["message"] for line in lines if line.startswith("{")]
    shown = "run owned by team-b\\x1b[31m\\x1b]0;pwned\\x07\\u202eevil\\nWARNING forged line"
    assert any(line.endswith(shown) for line in lines), lines
    # (A traceback keeps its lines, each cleaned: text.CleanFilter's documented behaviour.)
    assert lines[lines.index("reconcile of ns/name failed") - 1].endswith(shown)
