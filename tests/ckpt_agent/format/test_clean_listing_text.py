"""Stored names and reasons in the agent's warnings go through ``text.clean`` (issue #28): a
planted folder name, a planted link's name and target, an error quoting them. Whoever can
write the store chooses those bytes; a log line shows them escaped, one bounded line."""

from __future__ import annotations

import json
import logging
import os

import pytest

from ckpt_agent.errors import CheckpointFormatError, one_line
from ckpt_agent.format.layout import steps_prefix
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.text import DEFAULT_LIMIT

RUN = "run1"
#: A colour, an OSC window title ended by BEL, a right-to-left override, a newline and a
#: forged second log line.
EVIL = "pulse_step_1\x1b[31m\x1b]0;pwned\x07\u202eevil\nWARNING forged"
RAW = ("\x1b", "\x07", "\u202e", "\n")


def _raw(text: str) -> list[str]:
    return [c for c in RAW if c in text]


def test_one_line_escapes_and_caps_the_stored_text_an_error_quotes() -> None:
    shown = one_line(CheckpointFormatError(f"{EVIL}/COMMIT: bad" + "x" * 5000))
    assert _raw(shown) == [] and "\\x1b[31m" in shown and "\\u202e" in shown
    assert len(shown) <= DEFAULT_LIMIT and shown.endswith("more characters)")
    assert one_line(ValueError("plain words")) == "ValueError: plain words"


def test_a_planted_commit_is_one_bounded_line_in_the_listing_warning(
    ck_store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder that parses as a checkpoint id, holding a hostile COMMIT: the reader's error
    quotes its 20,000-character ``format``; the warning stays one line of at most a few
    hundred characters (``one_line`` cleans), no control character."""
    folder = ck_store.root / steps_prefix(RUN) / checkpoint_id(Tier.PULSE, 1)
    folder.mkdir(parents=True)
    evil = json.dumps(EVIL * 500)  # JSON escapes: the parsed string holds ESC, BEL, U+202E
    (folder / "COMMIT").write_bytes(b'{"format": ' + evil.encode() + b"}")
    with caplog.at_level(logging.WARNING, logger="ckpt_agent"):
        records = list_checkpoints(ck_store, RUN)
    assert [r.status for r in records] == [CheckpointStatus.CORRUPTED]
    assert len(records[0].extra["error"]) <= DEFAULT_LIMIT
    lines = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert _raw(lines[0]) == [] and len(lines[0]) < 2 * DEFAULT_LIMIT, lines[0][:200]
    assert "\\x1b[31m" in lines[0] and lines[0].endswith("more characters)")


def test_a_planted_link_name_and_target_are_logged_escaped(
    ck_store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    steps = ck_store.root / steps_prefix(RUN)
    steps.mkdir(parents=True)
    os.symlink("/tmp/\x1b]0;target\x07\u202e", steps / EVIL)
    with caplog.at_level(logging.WARNING, logger="ckpt_agent"):
        assert list(ck_store.list(steps_prefix(RUN))) == []
    lines = [r.getMessage() for r in caplog.records if "never followed" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert _raw(lines[0]) == [], lines[0]
    assert "\\x1b]0;pwned\\x07" in lines[0] and "\\x1b]0;target\\x07\\u202e" in lines[0]
