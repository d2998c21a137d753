"""The save-now signal: what the operator writes and the agent reads (torch-free).

The operator sets the pod annotation ``ckpt.dev/save-now``; the webhook mounts it into
the pod as the file ``$CKPT_SIGNAL_FILE`` (downward API) and the agent polls it: a change
of its content is one request. The content is one line::

    <request-id>                      save now: an emergency checkpoint
    <request-id> warning <message>    a node warning: save once, and the warning holds
    <request-id> clear <message>      the node's warning went

``<request-id>`` is short and stable per cause (the operator derives it from what
triggered the signal), so a repeated event writes the same content and is no new request.
A warning (the node is cordoned, NotReady, under pressure or tainted as going away) holds
until its ``clear``: the agent sizes its pulse interval for a higher failure hazard
meanwhile (:mod:`ckpt_agent.decide.hazard`). Any other content (a request id alone, free
text a person wrote) is a plain save-now — so an agent that predates warnings still saves.
The operator composes (:func:`compose_signal`) and the agent parses (:func:`parse_signal`)
with this one module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "KIND_CLEAR",
    "KIND_SAVE",
    "KIND_WARNING",
    "MAX_CHARS",
    "Signal",
    "compose_signal",
    "parse_signal",
]

KIND_SAVE: Final = "save"
KIND_WARNING: Final = "warning"
KIND_CLEAR: Final = "clear"
#: Characters of a signal the operator writes and the agent reads.
MAX_CHARS: Final = 200

SignalKind = Literal["save", "warning", "clear"]


@dataclass(frozen=True)
class Signal:
    """One request read from the signal file."""

    request: str
    """The request id (the first word)."""
    kind: SignalKind
    text: str
    """The whole content (cut to :data:`MAX_CHARS`), for logs and reasons."""

    @property
    def message(self) -> str:
        """What a warning or clear says, in words (the content after the kind)."""
        words = self.text.split(maxsplit=2)
        return words[2] if len(words) > 2 and self.kind != KIND_SAVE else self.text


def parse_signal(content: str) -> Signal | None:
    """The request in ``content`` (None: empty)."""
    text = content.strip()[:MAX_CHARS]
    if not text:
        return None
    words = text.split(maxsplit=2)
    kind: SignalKind = KIND_SAVE
    if len(words) >= 2 and words[1] == KIND_WARNING:
        kind = KIND_WARNING
    elif len(words) >= 2 and words[1] == KIND_CLEAR:
        kind = KIND_CLEAR
    return Signal(request=words[0], kind=kind, text=text)


def compose_signal(request: str, kind: SignalKind = KIND_SAVE, message: str = "") -> str:
    """The content for ``request`` of ``kind`` (one line, at most :data:`MAX_CHARS`)."""
    if kind == KIND_SAVE:
        return request
    line = " ".join(f"{request} {kind} {message}".split())
    return line[:MAX_CHARS]
