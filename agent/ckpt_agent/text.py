"""Stored text made safe to show: the one sanitizer of every stored string that reaches a
person (a log line, a Kubernetes Event, a status condition, terminal output).

A stored string (a run or checkpoint id, a file name from a listing, an ``OWNER.json``
namespace, a reason from ``VALIDATION.json``, an error message quoting any of them) may
hold whatever bytes whoever can write the storage put there. :func:`clean` turns it into
**one bounded line without control characters**:

* every character that is not printable is spelled out visibly: C0 controls, DEL and C1
  controls (``ESC`` → ``\\x1b``, ``BEL`` → ``\\x07``, ``CSI`` → ``\\x9b``; so an ANSI or OSC
  sequence becomes plain text and can neither colour, move, clear nor retitle a
  terminal), newlines and tabs (``\\n``, ``\\t``), bidi overrides and isolates (U+202A–U+202E,
  U+2066–U+2069 → ``\\u202e`` …), other format characters (zero-width, BOM), line and
  paragraph separators (U+2028/U+2029), non-ASCII spaces and unpaired surrogates (a file
  name that is not UTF-8);
* the result is at most ``limit`` characters, a cut one ending in a marker that says how
  much was left out (an escape sequence is never cut in half).

Clean text passes unchanged, and :func:`clean` is idempotent (``clean(clean(s)) ==
clean(s)`` for the same limit): the output is printable and within the limit. A
backslash is not escaped, so ``\\x1b`` in the output may have been four stored
characters; the output is for people, not a round trip.

:class:`CleanFormatter` does the same to a whole log record (message and traceback
lines), for a handler that shows records of code that did not clean its arguments;
:class:`CleanFilter` for a handler whose formatter is someone else's (kopf's).

No dependency beyond the standard library: every layer of the agent and the operator
may import it.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = [
    "DEFAULT_LIMIT",
    "EVENT_LIMIT",
    "LOG_LIMIT",
    "MIN_LIMIT",
    "STATUS_LIMIT",
    "CleanFilter",
    "CleanFormatter",
    "clean",
    "clean_error",
    "install_clean_last_resort",
    "is_clean",
]

#: Longest stored string shown by default (a table cell, one value in a message).
DEFAULT_LIMIT = 500
#: Longest Kubernetes Event message (kopf and the API cut at 1024 bytes).
EVENT_LIMIT = 1000
#: Longest status condition message (``kubectl describe`` shows it on one line).
STATUS_LIMIT = 2000
#: Longest rendered log message (one record's message, the traceback not counted).
LOG_LIMIT = 4000
#: The smallest limit: room for a little text and the cut marker.
MIN_LIMIT = 40

_SPECIAL = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    """One character as shown: itself when printable, else its escape."""
    if c.isprintable():
        return c
    special = _SPECIAL.get(c)
    if special is not None:
        return special
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    if n < 0x10000:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"


def is_clean(text: str, limit: int | None = DEFAULT_LIMIT) -> bool:
    """Whether ``text`` is already what :func:`clean` makes of it: printable, within limit."""
    return text.isprintable() and (limit is None or len(text) <= limit)


def clean(value: object, limit: int | None = DEFAULT_LIMIT) -> str:
    """``value`` (its ``str``) as one line of harmless text of at most ``limit`` characters
    (``None``: no cut), see the module docstring. Never raises on what ``str`` returns."""
    text = value if isinstance(value, str) else _str(value)
    if limit is not None and limit < MIN_LIMIT:
        raise ValueError(f"limit {limit} is under {MIN_LIMIT} characters")
    if is_clean(text, limit):
        return text
    # Each character shows as one or more, so only the first ``limit`` can be shown.
    head = text if limit is None else text[:limit]
    pieces = [_escape(c) for c in head]
    if limit is None:
        return "".join(pieces)
    shown = sum(map(len, pieces))
    if shown <= limit and len(head) == len(text):
        return "".join(pieces)
    # Cut: keep whole escapes while the kept text and the marker fit in ``limit``.
    kept = 0
    used = 0
    while True:
        marker = f"… ({len(text) - kept} more characters)"
        if kept == len(pieces) or used + len(pieces[kept]) + len(marker) > limit:
            # One more kept character may shorten the marker by a digit: that never
            # lets a piece in that did not fit, so this fixed point is the longest cut.
            break
        used += len(pieces[kept])
        kept += 1
    return "".join(pieces[:kept]) + f"… ({len(text) - kept} more characters)"


def _str(value: object) -> str:
    try:
        return str(value)
    except Exception as e:  # a hostile __str__: say so instead of failing the caller
        return f"<unprintable {type(value).__name__}: {type(e).__name__}>"


def clean_error(error: BaseException, limit: int | None = DEFAULT_LIMIT) -> str:
    """``"<ErrorClass>: <message>"`` through :func:`clean` (``no details`` for an empty one)."""
    text = _str(error).strip() or "no details"
    return clean(f"{type(error).__name__}: {text}", limit)


class CleanFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose output has no control characters from the record:
    the message (its arguments filled in) through :func:`clean` (``limit``), each line of a
    traceback through :func:`clean` too (a traceback keeps its lines; none is cut)."""

    def __init__(
        self, fmt: str | None = None, datefmt: str | None = None, limit: int = LOG_LIMIT
    ) -> None:
        super().__init__(fmt, datefmt)
        self.limit = limit

    def format(self, record: logging.LogRecord) -> str:
        shown = logging.makeLogRecord(record.__dict__)
        shown.msg = clean(record.getMessage(), self.limit)
        shown.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        shown.exc_info = None
        shown.exc_text = (
            "\n".join(clean(line, None) for line in record.exc_text.splitlines())
            if record.exc_text
            else None
        )
        if record.stack_info:
            shown.stack_info = "\n".join(clean(x, None) for x in record.stack_info.splitlines())
        return super().format(shown)


class CleanFilter(logging.Filter):
    """A :class:`logging.Filter` for a handler whose formatter is someone else's (kopf's):
    it replaces each record's message by its :func:`clean` text (arguments filled in) and
    its traceback by cleaned lines, so whatever formats the record next shows clean text.
    The record is changed in place (the handlers after this one see the clean text too)."""

    def __init__(self, limit: int = LOG_LIMIT) -> None:
        super().__init__()
        self.limit = limit
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not is_clean(message, self.limit):
            record.msg, record.args = clean(message, self.limit), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = "\n".join(clean(x, None) for x in record.exc_text.splitlines())
        return True


class _CleanLastResort(logging.StreamHandler[TextIO]):
    """:data:`logging.lastResort` with a :class:`CleanFormatter`: warnings of a process that
    configured no logging (the ``ckpt`` command) still reach stderr, cleaned."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(CleanFormatter("%(message)s"))

    @property
    def stream(self) -> TextIO:  # the current stderr, as logging's own last resort does
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def install_clean_last_resort() -> None:
    """Make :data:`logging.lastResort` (the handler of a process with none configured) clean
    what it prints. Idempotent; a process that configures logging keeps its handlers."""
    if not isinstance(logging.lastResort, _CleanLastResort):
        logging.lastResort = _CleanLastResort()
