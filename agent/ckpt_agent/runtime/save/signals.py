"""Requests from outside the training loop, and the L0 heartbeat.

:class:`SignalWatch` notices the operator's save-now signal file (a change of
its content is one request, :mod:`ckpt_agent.format.signal`): a plain save-now
is an emergency checkpoint; a node warning is one too, and holds
(:attr:`SignalWatch.node_warning`, a
:attr:`~ckpt_agent.decide.signals.SystemSignals.node_warning` at every step: a
higher failure hazard, a shorter pulse interval) until the operator clears it.
When asked, it installs a SIGTERM handler that only sets a flag — the training
thread acts on it at the next step.
The L0 heartbeat is :mod:`ckpt_agent.runtime.save.heartbeat`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ckpt_agent.format.signal import KIND_CLEAR, KIND_WARNING, Signal, parse_signal
from ckpt_agent.runtime.core.context import Engine

__all__ = ["SignalWatch"]

log = logging.getLogger(__name__)


class SignalWatch:
    """The save-now signal file and the SIGTERM flag."""

    def __init__(self, signal_file: str | None) -> None:
        self.path = signal_file or None
        self.sigterm = False
        """A SIGTERM arrived (set by the handler, cleared once handled)."""
        self.node_warning: str | None = None
        """The operator's node warning while it holds (until its clear), in words."""
        self._seen: tuple[int, int] | None = None
        self._content: bytes | None = None
        self._old_handler: Any = None

    @property
    def installed(self) -> bool:
        """Our SIGTERM handler is in place (the previous one is kept to put back)."""
        return self._old_handler is not None

    def arm(self) -> None:
        """Remember the signal file as it is now: only a later change is a request."""
        if not self.path:
            return
        try:
            st = os.stat(self.path)
            self._seen = (st.st_mtime_ns, st.st_size)
            self._content = Path(self.path).read_bytes()
        except OSError:
            self._seen = None
            self._content = None

    def poll(self) -> Signal | None:
        """The new request in the signal file (None: no change, or an empty file)."""
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            content = Path(self.path).read_bytes()
        except OSError:
            return None
        if content == self._content:
            return None
        self._content = content
        return parse_signal(content.decode(errors="replace"))

    def poll_request(self, engine: Engine, *, agreed: bool) -> bool:
        """Act on a new request: a save-now or a node warning is the scheduler's emergency,
        or (``agreed``: several ranks) True — the caller hands it to the agreement so every
        rank's scheduler gets it. A warning holds until a clear (:attr:`node_warning`)."""
        sig = self.poll()
        if sig is None:
            return False
        engine.event("signal", file=self.path, request=sig.text, kind=sig.kind)
        if sig.kind == KIND_CLEAR:
            self.node_warning = None
            return False
        if sig.kind == KIND_WARNING:
            self.node_warning = sig.message
        if not agreed:
            engine.scheduler.request_emergency(
                f"save-now signal {sig.text!r}", warning=sig.kind == KIND_WARNING
            )
        return agreed

    def install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("handle_sigterm needs the main thread; SIGTERM handler not installed")
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            del signum, frame
            self.sigterm = True

        self._old_handler = signal.signal(signal.SIGTERM, handler)

    def restore_sigterm(self) -> None:
        if self._old_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None
