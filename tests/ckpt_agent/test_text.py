"""The one sanitizer of stored text shown to people (issue #28): every control, bidi and
separator character escaped visibly, length capped, idempotent, clean text unchanged."""

from __future__ import annotations

import io
import logging
import random
import sys
import unicodedata

import pytest

from ckpt_agent.text import (
    DEFAULT_LIMIT,
    MIN_LIMIT,
    CleanFilter,
    CleanFormatter,
    clean,
    clean_error,
    install_clean_last_resort,
    is_clean,
)

#: A colour, a screen clear, an OSC window title ended by BEL and by ST, C1 CSI, a newline,
#: a right-to-left override, an isolate, a line separator, a zero-width joiner, a BOM.
EVIL = (
    "run\x1b[31mred\x1b[2J\x1b]0;title\x07\x1b]8;;http://x\x1b\\\x9b1m\nnext"
    "\u202eevil\u2066iso\u2069\u2028line\u200dzw\ufeff"
)
BIDI = [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
DANGEROUS_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _dangerous(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) in DANGEROUS_CATEGORIES]


def test_every_control_bidi_and_separator_character_is_escaped_visibly() -> None:
    for n in [*range(0x20), 0x7F, *range(0x80, 0xA0), *BIDI, 0x2028, 0x2029, 0xFEFF, 0x200B]:
        shown = clean(f"a{chr(n)}b")
        assert chr(n) not in shown, hex(n)
        assert shown.startswith("a\\") and shown.endswith("b") and shown.isprintable(), hex(n)
    assert clean("\x1b") == "\\x1b" and clean("\x07") == "\\x07" and clean("\x9b") == "\\x9b"
    assert clean("\u202e") == "\\u202e" and clean("\u2069") == "\\u2069"
    assert clean("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert clean("\U000e0001") == "\\U000e0001"  # a tag character (Cf) outside the BMP
    assert clean("name\udc80\udcff") == "name\\udc80\\udcff"  # a file name that is not UTF-8


def test_ansi_and_osc_sequences_become_plain_text() -> None:
    shown = clean(EVIL)
    assert _dangerous(shown) == [] and "\x1b" not in shown and "\x07" not in shown
    assert "\\x1b[31mred\\x1b[2J\\x1b]0;title\\x07" in shown
    assert "\\u202eevil\\u2066iso\\u2069\\u2028line\\u200dzw\\ufeff" in shown
    assert "\\n" in shown and "\n" not in shown


def test_clean_text_passes_unchanged() -> None:
    for text in ("", "run-1", "pulse_step_00000010", "ünïcødé 名前 ✓", "a b", "[bold]x[/]"):
        assert clean(text) == text and is_clean(text)
    assert clean(42) == "42" and clean(None) == "None"


def test_the_length_is_capped_with_a_marker_and_no_escape_is_cut() -> None:
    shown = clean("x" * 10_000)
    assert len(shown) == DEFAULT_LIMIT and shown.endswith("… (9524 more characters)")
    shown = clean("\x1b" * 1000, 50)
    head, _, tail = shown.partition("…")
    assert len(shown) <= 50 and head == "\\x1b" * (len(head) // 4) and head
    assert tail == f" ({1000 - len(head) // 4} more characters)"
    # Short text whose escapes overflow the limit is cut too.
    assert len(clean("\u202e" * 45, 60)) <= 60
    assert clean("y" * 10_000, None) == "y" * 10_000
    with pytest.raises(ValueError, match="under"):
        clean("x", MIN_LIMIT - 1)


def test_a_hostile_str_does_not_fail_the_caller() -> None:
    class Bad:
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert clean(Bad()) == "<unprintable Bad: RuntimeError>"


def test_clean_error_names_the_class() -> None:
    assert clean_error(OSError("bad\x1b[2J\nthing")) == "OSError: bad\\x1b[2J\\nthing"
    assert clean_error(ValueError("")) == "ValueError: no details"


def _alphabet() -> list[str]:
    hostile = [chr(n) for n in [*range(0x20), *range(0x7F, 0xA0), *BIDI, 0x2028, 0x2029]]
    other = ["\ufeff", "\u200b", "\u200d", "\udc80", "\U000e0041", "\u00a0", "\\", "…"]
    printable = [*"abcXYZ019 _-./:[]{}()'\"", "é", "名", "✓", "\U0001f600"]
    return hostile + other + printable


@pytest.mark.parametrize("seed", range(8))
def test_property_output_is_clean_bounded_and_idempotent(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = _alphabet()
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 900)))
        limit = rng.choice([MIN_LIMIT, 64, 200, DEFAULT_LIMIT, 1000, None])
        shown = clean(text, limit)
        assert shown.isprintable() and _dangerous(shown) == []
        assert not any(chr(n) in shown for n in BIDI)
        assert limit is None or len(shown) <= limit
        assert clean(shown, limit) == shown  # idempotent
        if limit is None or len(text) <= limit:
            assert (shown == text) == text.isprintable()


@pytest.mark.parametrize("seed", range(4))
def test_property_clean_text_is_unchanged(seed: int) -> None:
    rng = random.Random(seed)
    printable = [c for c in _alphabet() if c.isprintable()]
    for _ in range(300):
        text = "".join(rng.choice(printable) for _ in range(rng.randrange(0, DEFAULT_LIMIT + 1)))
        assert clean(text) == text


def _record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("t", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_the_formatter_cleans_message_arguments_and_traceback_lines() -> None:
    try:
        raise OSError(f"cannot open {EVIL}")
    except OSError as e:
        record = _record("listing %s: skipped %s (%d)", "/store/run", EVIL, 3, exc=e)
    out = CleanFormatter("%(levelname)s %(message)s").format(record)
    assert _dangerous(out.replace("\n", "")) == []
    first, *rest = out.split("\n")
    assert (
        first.startswith("WARNING listing /store/run: skipped run\\x1b[31mred") and "(3)" in first
    )
    assert (
        rest[0] == "Traceback (most recent call last):" and "OSError: cannot open run\\x1b" in out
    )
    assert record.args == ("/store/run", EVIL, 3)  # the record itself is left alone


def test_the_formatter_caps_a_message() -> None:
    out = CleanFormatter("%(message)s", limit=100).format(_record("%s", "z" * 10_000))
    assert len(out) == 100


def test_the_last_resort_handler_prints_cleaned_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging, "lastResort", logging.lastResort)
    install_clean_last_resort()
    handler = logging.lastResort
    install_clean_last_resort()
    assert logging.lastResort is handler  # idempotent
    assert handler is not None
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    log = logging.getLogger("test_text.unconfigured")
    monkeypatch.setattr(log, "propagate", False)  # no handler: logging uses its last resort
    log.warning("skipped %s", EVIL)
    log.info("quiet")
    out = buf.getvalue()
    assert out.count("\n") == 1 and out.startswith("skipped run\\x1b[31mred")
    assert _dangerous(out.rstrip("\n")) == []


def test_the_filter_cleans_records_for_any_formatter() -> None:
    try:
        raise OSError(f"cannot open {EVIL}")
    except OSError as e:
        record = _record("listing %s: skipped %s (%d)", "/store/run", EVIL, 3, exc=e)
    assert CleanFilter().filter(record) is True
    assert record.args is None and record.getMessage().startswith("listing /store/run: skipped")
    out = logging.Formatter("%(name)s %(message)s").format(record)
    assert _dangerous(out.replace("\n", "")) == [] and "\\x1b]0;title\\x07" in out
    assert "Traceback (most recent call last):" in out
    clean_record = _record("run %s committed %d", "run-1", 5)
    CleanFilter().filter(clean_record)
    assert clean_record.args == ("run-1", 5)  # clean text is left as it was
