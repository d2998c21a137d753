"""Status conditions never carry stored text raw (issue #28): ``kubectl describe`` shows one
bounded line without control or bidi characters, whatever the caller passed."""

from __future__ import annotations

from ckpt_agent.text import STATUS_LIMIT
from ckpt_operator.planners.status import REASON_LIMIT, condition_differs, set_condition
from ckpt_operator.planners.tenancy import MAX_ERROR_CHARS, owner_refusal, summarize_error

T0 = 1_700_000_000.0
#: An OWNER.json namespace as a hostile writer of the storage may plant it.
EVIL_NS = "team-b\x1b[31m\x1b]0;pwned\x07\nforged\u202eevil\u2066x\u2069\u2028" + "n" * 3200
RAW = ("\x1b", "\x07", "\n", "\u202e", "\u2066", "\u2069", "\u2028")


def _raw(text: str) -> list[str]:
    return [c for c in RAW if c in text]


def test_a_condition_quoting_an_owner_namespace_is_one_bounded_clean_line() -> None:
    refusal = owner_refusal("run-1", EVIL_NS, "team-a")
    assert refusal is not None and len(refusal) > 3000
    (cond,) = set_condition(None, "Ready", "False", "RunOwned\x1b[2J" * 50, refusal, now=T0)
    assert _raw(cond["message"]) == [] and _raw(cond["reason"]) == []
    assert len(cond["message"]) <= STATUS_LIMIT and len(cond["reason"]) <= REASON_LIMIT
    assert "team-b\\x1b[31m\\x1b]0;pwned\\x07\\nforged\\u202eevil" in cond["message"]
    # An update of the same condition is cleaned the same way (and clean text unchanged).
    (again,) = set_condition([cond], "Ready", "False", "RunOwned", refusal, now=T0 + 1)
    assert again["message"] == cond["message"] and again["reason"] == "RunOwned"
    (ok,) = set_condition([again], "Ready", "True", "Validated", "policy is valid", now=T0)
    assert (ok["reason"], ok["message"]) == ("Validated", "policy is valid")


def test_an_error_summary_is_escaped_and_bounded() -> None:
    line = summarize_error(PermissionError(f"open /mnt/{EVIL_NS}/OWNER.json\r\u202e"))
    assert _raw(line) == [] and "\r" not in line and len(line) <= MAX_ERROR_CHARS
    assert line.startswith("PermissionError: open /mnt/team-b\\x1b[31m\\x1b]0;pwned\\x07")
    assert summarize_error(OSError("first\nsecond <body>")) == "OSError: first"


def test_a_condition_as_stored_is_not_new_on_the_next_pass() -> None:
    """A message the sanitizer changes (a bidi override, a length past the limit) compares
    equal to what was stored from it: no status write on every pass."""
    for message in ("pod p\u202eq: agent missing", "x" * (STATUS_LIMIT + 50), "plain"):
        (stored,) = set_condition(None, "AgentReporting", "False", "AgentMissing", message, now=0)
        assert not condition_differs(stored, "False", "AgentMissing", message)
        assert condition_differs(stored, "True", "AgentMissing", message)
        assert condition_differs(stored, "False", "AgentsReporting", message)
        assert condition_differs(stored, "False", "AgentMissing", message + "!")
    assert condition_differs(None, "True", "R", "m")
