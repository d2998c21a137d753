"""The ``ckpt.dev/status`` annotation (``kubectl describe`` shows it) holds clean text only
(issue #28): its reason and message quote stored ids, reasons and errors."""

from __future__ import annotations

import json

from ckpt_agent.text import STATUS_LIMIT
from ckpt_operator.model.jobs import JobStatusAnnotation

EVIL = "team-b\x1b[31m\x1b]0;pwned\x07\x1b[2J\nWarning Forged: all good\u202eevil\u2028"
RAW = ("\x1b", "\x07", "\n", "\u202e", "\u2028")


def test_reason_and_message_are_escaped_and_capped() -> None:
    status = JobStatusAnnotation("GaveUp", "Owner" + EVIL, "run owned by " + EVIL * 200)
    data = json.loads(status.to_json())
    for field in ("reason", "message"):
        assert [c for c in RAW if c in data[field]] == [], field
        assert len(data[field]) <= STATUS_LIMIT
    assert data["message"].startswith("run owned by team-b\\x1b[31m\\x1b]0;pwned\\x07\\x1b[2J\\n")
    assert data["message"].endswith("more characters)") and data["state"] == "GaveUp"
    assert JobStatusAnnotation.parse(status.to_json()) is not None


def test_clean_text_is_stored_unchanged() -> None:
    status = JobStatusAnnotation("Watching", "PolicyFound", "using policy ckpt-default", "t")
    assert JobStatusAnnotation.parse(status.to_json()) == status
