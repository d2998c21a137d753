"""Peers' copies of each rank's step heartbeat: a lost node's JIT record lives on.

A just-in-time save (docs/replicas.md) restores a dead rank with the survivors' replicated
state and the dead rank's own step heartbeat (its RNG and data position at the last step
it finished, :mod:`ckpt_agent.flash.step_heartbeat`). When the whole node is lost, that
record goes with its memory, so with replication on the sidecar pushes every new record to
the same k peers as the snapshots (:meth:`~.replicator.Replicator.offer_mark`), and a rank
recreated on another node gets it back with its replica
(:mod:`ckpt_agent.flash.sidecar.rehydration`).

Here: the receiver's store (``<shm_dir>/<run_id>/replica-marks/<source>/rank_<n>.rec``:
one record per source node and rank, checked before it is kept, never an older one over a
newer one, written atomically; nothing outside that folder is written), the server's two
requests (``mark``: a peer pushes one; ``get_mark``: the newest record of a rank held
here) and their client calls. A record is a few KB (RNG states and the data position):
one small authenticated connection per push. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.errors import ReplicaError
from ckpt_agent.flash.protocol import atomic_write, read_file
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import DEFAULT_TIMEOUT_S, Peer, open_connection
from ckpt_agent.flash.replica.layout import subdirs
from ckpt_agent.flash.replica.wire import Conn, Frame
from ckpt_agent.flash.step_heartbeat import HALF_BYTES, StepHeartbeat, decode_record
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.records import rank_name
from ckpt_agent.text import clean

__all__ = ["HeldMark", "MarkRelay", "MarkStore", "fetch_mark", "push_mark", "serve_mark"]

log = logging.getLogger(__name__)

MARKS_DIR = "replica-marks"


@dataclass(frozen=True)
class HeldMark:
    """A rank's step heartbeat record held here, from ``source``."""

    source: str
    rank: int
    raw: bytes
    record: StepHeartbeat


class MarkStore:
    """The step heartbeat records peers pushed to this node (see the module doc)."""

    def __init__(self, shm_dir: str | Path, run_id: str) -> None:
        self.root = Path(shm_dir) / validate_run_id(run_id) / MARKS_DIR

    def path(self, source: str, rank: int) -> Path:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ReplicaError(f"invalid rank {rank!r} for a step heartbeat")
        return self.root / validate_run_id(source) / f"{rank_name(rank)}.rec"

    def put(self, source: str, rank: int, raw: bytes) -> StepHeartbeat:
        """Keep ``raw`` (checked) unless the record held is newer (a later sequence number
        of the same area); returns the record."""
        try:
            record = decode_record(bytes(raw))
        except ValueError as e:
            raise ReplicaError(f"a step heartbeat of rank {rank} from {source}: {e}") from None
        path = self.path(source, rank)
        held = self._load(source, rank, path)
        if held is not None and held.record.seq > record.seq:
            return held.record
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, bytes(raw))
        return record

    def _load(self, source: str, rank: int, path: Path) -> HeldMark | None:
        raw = read_file(path)
        if raw is None:
            return None
        try:
            return HeldMark(source, rank, raw, decode_record(raw))
        except ValueError:
            return None  # torn or corrupted at rest: as if none

    def newest(self, rank: int) -> HeldMark | None:
        """The newest record of ``rank`` held here (by its wall time, across source nodes:
        the rank may have moved between nodes)."""
        found = []
        for src in subdirs(self.root):
            with contextlib.suppress(ValueError, ReplicaError):
                held = self._load(src.name, rank, self.path(src.name, rank))
                if held is not None:
                    found.append(held)
        return max(found, key=lambda h: h.record.heartbeat.time, default=None)


def serve_mark(store: MarkStore, conn: Conn, req: Frame) -> None:
    """The server's side of ``mark`` and ``get_mark`` (after the handshake)."""
    rank = req.header.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ReplicaError("a step heartbeat request names a rank")
    if req.kind == "mark":
        source = req.header.get("source")
        if not isinstance(source, str):
            raise ReplicaError("a step heartbeat push names its source node")
        record = store.put(source, rank, bytes(req.payload))
        conn.send({"t": "marked", "step": record.heartbeat.step, "seq": record.seq})
        return
    held = store.newest(rank)
    if held is None:
        conn.send({"t": "nomark"})
    else:
        conn.send({"t": "mark", "source": held.source}, held.raw)


def push_mark(
    peer: Peer,
    scope: JobScope,
    *,
    source: str,
    rank: int,
    raw: bytes,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Push one step heartbeat record of ``rank`` (this node ``source``'s) to ``peer``."""
    if len(raw) > HALF_BYTES:
        raise ReplicaError(f"a step heartbeat record of {len(raw)} bytes")
    conn = open_connection(peer, scope, timeout_s=timeout_s)
    try:
        conn.send({"t": "mark", "source": source, "rank": rank}, raw)
        conn.expect("marked")
    finally:
        conn.close()


def fetch_mark(
    peer: Peer, scope: JobScope, rank: int, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> HeldMark | None:
    """The newest step heartbeat record of ``rank`` that ``peer`` holds (checked), or None."""
    conn = open_connection(peer, scope, timeout_s=timeout_s)
    try:
        conn.send({"t": "get_mark", "rank": rank})
        reply = conn.expect("mark", "nomark")
    finally:
        conn.close()
    if reply.kind == "nomark":
        return None
    source = reply.header.get("source")
    if not isinstance(source, str):
        raise ReplicaError(f"{peer} answered a step heartbeat request with {reply.header}")
    raw = bytes(reply.payload)
    try:
        return HeldMark(source, rank, raw, decode_record(raw))
    except ValueError as e:
        raise ReplicaError(f"{peer}'s step heartbeat of rank {rank}: {e}") from None


class MarkRelay:
    """Pushes each rank's newest step heartbeat record to the peers from a thread of its own
    (:meth:`offer` returns at once; records that come faster than they can be pushed are
    coalesced to the newest of each rank; a failed push is counted, the next one goes on).
    Never behind a snapshot's push: a record is what a JIT restart needs first."""

    def __init__(
        self, peers: Sequence[Peer], scope: JobScope, *, source: str, timeout_s: float
    ) -> None:
        self.peers = list(peers)
        self.scope = scope
        self.source = source
        self.timeout_s = timeout_s
        self.pushed = 0
        self.failed = 0
        self.last_error = ""
        self._pending: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-replica-marks", daemon=True)
        self._thread.start()

    def offer(self, rank: int, raw: bytes) -> None:
        if not self.peers:
            return
        with self._cond:
            self._pending[rank] = raw
            self._cond.notify()

    def set_peers(self, peers: Sequence[Peer]) -> None:
        """Push to ``peers`` from the next record on (the peer map changed)."""
        self.peers = list(peers)

    def idle(self) -> bool:
        with self._cond:
            return not self._pending and not self._busy

    def close(self, timeout_s: float = 1.0) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                rank = min(self._pending)
                raw = self._pending.pop(rank)
                self._busy = True
            try:
                for peer in self.peers:
                    try:
                        push_mark(
                            peer, self.scope, source=self.source, rank=rank, raw=raw,
                            timeout_s=self.timeout_s,
                        )  # fmt: skip
                    except (ReplicaError, OSError) as e:
                        log.warning("pushing rank %d's step heartbeat to %s failed: %s",
                                    rank, peer, clean(e))  # fmt: skip
                        with self._cond:
                            self.failed += 1
                            self.last_error = f"{peer}: {e}"
                        continue
                    with self._cond:
                        self.pushed += 1
            finally:
                with self._cond:
                    self._busy = False
