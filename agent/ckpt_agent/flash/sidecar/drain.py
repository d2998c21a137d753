"""Stopping well: the SIGTERM emergency drain, and the operator's save-now signal file.

SIGTERM (eviction, drain) starts an *emergency drain*: the loop persists every
complete snapshot not yet persisted and exits before the grace period ends.
A change of the save-now signal file is logged and counted (the trainer takes
the new snapshot; the loop flushes whatever is pending).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from types import FrameType

from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.format.signal import KIND_CLEAR, parse_signal
from ckpt_agent.persist.finalize import EventSink

__all__ = ["Drain"]


class Drain:
    """The drain deadline, the stop flag and the save-now signal file (see the module doc)."""

    def __init__(
        self,
        grace_s: float,
        metrics: SidecarMetrics,
        emit: EventSink,
        *,
        signal_file: str | None = None,
    ) -> None:
        self.grace_s = grace_s
        self.metrics = metrics
        self.emit = emit
        self.signal_file = signal_file
        self.stop = threading.Event()
        """Set by a drain request (or :meth:`request_stop`): the loop wakes up."""
        self.deadline: float | None = None
        self.reason = ""
        self._signal_seen: bytes | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def time_left(self) -> float:
        """Seconds until the drain deadline (infinite when not draining)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def request(self, reason: str) -> None:
        """Persist what is pending now and stop within the grace period (SIGTERM)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
            self.reason = reason
            self.emit("drain", reason=reason, grace_s=self.grace_s)
        self.stop.set()

    def stopping(self) -> bool:
        """Stop requested without a drain: waits (a commit's) should give up."""
        return self.stop.is_set() and not self.draining

    def poll_signal(self) -> None:
        """Log and count a new save-now request in the signal file."""
        path = self.signal_file
        if not path:
            return
        try:
            content = Path(path).read_bytes()
        except OSError:
            return
        if self._signal_seen is None:
            self._signal_seen = content
            return
        if content != self._signal_seen:
            self._signal_seen = content
            sig = parse_signal(content.decode(errors="replace"))
            if sig is not None:
                self.emit("signal", request=sig.text, kind=sig.kind)
                if sig.kind != KIND_CLEAR:  # a node warning's clearing asks for no save
                    self.metrics.emergency.labels(trigger="signal").inc()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start a drain."""

        def on_term(signum: int, frame: FrameType | None) -> None:
            del frame
            self.request(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
