"""The sidecar's replication: serve peers' replicas, push this node's snapshots to its peers.

:class:`Replicator` is what the persister sidecar runs when :class:`ReplicaOptions` are
set (off by default): a :class:`~.server.ReplicaServer` for the peers that push here (when
``listen_port`` is set) and one background thread that pushes every snapshot the sidecar
handled to each peer (:func:`~.client.push`). :meth:`Replicator.offer` only records the
snapshot and returns: the persist loop never waits for the network. When snapshots come
faster than they can be pushed, only the newest of each rank is pushed (a replica is only
worth its newest snapshot). A failed push is logged and counted, never fatal; the next
snapshot is pushed as usual. While a snapshot is pushed its slot is held with a shared
lock, like the persister's read: the trainer writes its next snapshot into the other slot.

The peers are the webhook's ring until the operator's rack/zone-aware peer map is there
(``peers_file``, re-read every ``peers_refresh_s`` by the pusher thread,
:class:`~.peer_map.PeerMap`). When they change, the newest snapshot of each rank is pushed
at once to the peers that are new (all of it: they hold nothing of it), and the step
heartbeats go to the new peers from then on. Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_agent.errors import ReplicaError
from ckpt_agent.flash.checksums import HASH_CHUNK_BYTES, RecordedHashes
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import DEFAULT_TIMEOUT_S, Peer, PushResult, push
from ckpt_agent.flash.replica.marks import MarkRelay, MarkStore
from ckpt_agent.flash.replica.peer_map import DEFAULT_REFRESH_S, PeerMap
from ckpt_agent.flash.replica.plan import plan_chunks
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.records import Json
from ckpt_agent.text import clean

__all__ = ["ReplicaOptions", "Replicator"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaOptions:
    """Peer replication of one job's snapshots (``docs/replicas.md``)."""

    node: str
    """This node's name: the folder its replicas have on the peers."""
    namespace: str
    job_id: str
    secret_file: str
    """The per-job secret (the mounted Secret ``ckpt-replica-<job>``)."""
    peers: tuple[str, ...] = ()
    """``host:port`` of the k peer sidecars this node pushes to (the webhook's ring)."""
    peers_file: str | None = None
    """This rank's file of the operator's peer map (``host:port,…``): its peers while it
    is there and well formed (None: always ``peers``)."""
    peers_refresh_s: float = DEFAULT_REFRESH_S
    """How often ``peers_file`` is read."""
    listen_host: str = "0.0.0.0"
    listen_port: int | None = None
    """Serve peers' pushes and fetches on this port (None: push only)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_snapshot_bytes: int | None = None
    """The largest replica this node accepts from a peer (None: any)."""
    chunk_bytes: int = field(default=HASH_CHUNK_BYTES)


class Replicator:
    """Serves replicas and pushes this node's snapshots (see the module doc)."""

    def __init__(self, options: ReplicaOptions, shm_dir: str | Path, run_id: str) -> None:
        self.options = options
        self.scope = JobScope.from_file(options.namespace, options.job_id, options.secret_file)
        self.peer_map = PeerMap(
            [Peer.parse(p) for p in options.peers],
            options.peers_file,
            refresh_s=options.peers_refresh_s,
        )
        self.store = ReplicaStore(shm_dir, run_id, max_snapshot_bytes=options.max_snapshot_bytes)
        self.mark_store = MarkStore(shm_dir, run_id)
        """Peers' step heartbeat records (JIT saves), served with the replicas."""
        self.server: ReplicaServer | None = None
        if options.listen_port is not None:
            try:
                server = ReplicaServer(
                    self.store,
                    self.scope,
                    host=options.listen_host,
                    port=options.listen_port,
                    timeout_s=options.timeout_s,
                    marks=self.mark_store,
                )
            except OSError as e:
                raise ReplicaError(
                    f"cannot serve replicas on {options.listen_host}:{options.listen_port}: "
                    f"{e} (another process on the port? choose another replica port)"
                ) from None
            self.server = server.start()
        self.pushed = 0
        self.failed = 0
        self.superseded = 0
        self.bytes_sent = 0
        """Chunk bytes sent by every push (what the changed chunks cost the network)."""
        self.last_error = ""
        self.last: PushResult | None = None
        self.last_lag_s: float | None = None
        """Seconds from the last pushed snapshot's write (trainer) to its push done."""
        self._pending: dict[int, tuple[ShmReader, Descriptor, tuple[Peer, ...] | None]] = {}
        """rank → the snapshot to push and to whom (None: every current peer)."""
        self._newest: dict[int, tuple[ShmReader, Descriptor]] = {}
        """rank → the newest snapshot offered (pushed again to a new peer)."""
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self.marks = MarkRelay(
            self.peers, self.scope, source=options.node, timeout_s=options.timeout_s
        )
        """Step heartbeat records (JIT saves), pushed beside the snapshots."""
        self._thread = threading.Thread(target=self._run, name="ckpt-replica-push", daemon=True)
        self._thread.start()

    @property
    def peers(self) -> list[Peer]:
        """The peers pushed to now (the peer map's, else the ring)."""
        return list(self.peer_map.peers)

    def named_peers(self) -> list[Peer]:
        """Every peer named so far, the current ones first: the peers that may hold a
        replica of this node's ranks (what a recreated rank asks)."""
        return list(self.peer_map.named)

    def offer(self, reader: ShmReader, desc: Descriptor) -> None:
        """Push ``desc`` (a complete snapshot of ``reader``'s area) soon; returns at once."""
        with self._cond:
            self._newest[desc.rank] = (reader, desc)
            if not self.peers:
                return
            if desc.rank in self._pending:
                self.superseded += 1
            self._pending[desc.rank] = (reader, desc, None)
            self._cond.notify()

    def offer_mark(self, rank: int, raw: bytes) -> None:
        """Push rank ``rank``'s newest step heartbeat record soon; returns at once."""
        self.marks.offer(rank, raw)

    def idle(self) -> bool:
        """Nothing pending and no push in flight (snapshots and step heartbeats)."""
        with self._cond:
            return not self._pending and not self._busy and self.marks.idle()

    def summary(self) -> dict[str, Json]:
        with self._cond:
            out: dict[str, Json] = {
                "peers": [str(p) for p in self.peers],
                "peers_from": self.peer_map.source,
                "pushed": self.pushed,
                "failed": self.failed,
                "superseded": self.superseded,
                "bytes_sent": self.bytes_sent,
                "last_step": None if self.last is None else self.last.step,
                "last_lag_s": None if self.last_lag_s is None else round(self.last_lag_s, 6),
                "last_error": self.last_error or None,
                "marks_pushed": self.marks.pushed,
                "marks_failed": self.marks.failed,
            }
        if self.server is not None:
            stats = self.server.stats
            out["served"] = {"stored": stats.stored, "refused": stats.refused}
        return out

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop pushing and serving; a push in flight is waited for ``timeout_s`` at most
        (a drain does not wait for the network; the thread ends within its timeout)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
        self._thread.join(timeout_s)
        self.marks.close(timeout_s)
        if self.server is not None:
            self.server.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    wait = self.peer_map.due_in()
                    if wait == 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
            self._refresh_peers()
            with self._cond:
                if not self._pending:
                    continue
                rank = min(self._pending)
                reader, desc, targets = self._pending.pop(rank)
                self._busy = True
            try:
                self._push(reader, desc, targets)
            except Exception as e:  # the pusher thread never dies; the next snapshot is pushed
                log.warning("replicating rank %d failed: %s", desc.rank, clean(e))
                with self._cond:
                    self.failed += 1
                    self.last_error = f"{type(e).__name__}: {e}"
            finally:
                with self._cond:
                    self._busy = False

    def _refresh_peers(self) -> None:
        """Read the peer map when due; new peers get the newest snapshot of every rank now
        (a rank already waiting for its push gets it with that push)."""
        before = set(self.peer_map.peers)
        if not self.peer_map.refresh():
            return
        now = self.peer_map.peers
        self.marks.set_peers(now)
        new = tuple(p for p in now if p not in before)
        with self._cond:
            if not new:
                return
            for rank, (reader, desc) in self._newest.items():
                if rank not in self._pending:
                    self._pending[rank] = (reader, desc, new)
            self._cond.notify()

    def _push(
        self, reader: ShmReader, desc: Descriptor, targets: tuple[Peer, ...] | None = None
    ) -> None:
        """Push ``desc`` to ``targets`` (None: every current peer)."""
        with reader.open(desc) as snap:
            if snap is None:  # overwritten meanwhile: a newer snapshot is coming
                with self._cond:
                    self.superseded += 1
                return
            hashes = _usable(reader.hashes(desc.slot, desc.seq), desc, self.options.chunk_bytes)
            for peer in targets if targets is not None else self.peers:
                try:
                    result = push(
                        peer,
                        self.scope,
                        desc,
                        snap.view,
                        hashes,
                        source=self.options.node,
                        chunk_bytes=self.options.chunk_bytes,
                        timeout_s=self.options.timeout_s,
                    )
                except (ReplicaError, OSError) as e:
                    log.warning(
                        "replicating %s of rank %d to %s failed: %s",
                        desc.checkpoint_id,
                        desc.rank,
                        peer,
                        clean(e),
                    )
                    with self._cond:
                        self.failed += 1
                        self.last_error = f"{peer}: {e}"
                    continue
                with self._cond:
                    self.pushed += 1
                    self.bytes_sent += result.bytes_sent
                    self.last = result
                    self.last_lag_s = max(0.0, time.time() - desc.created_at)


def _usable(
    hashes: RecordedHashes | None, desc: Descriptor, chunk_bytes: int
) -> RecordedHashes | None:
    """The persister's recorded hashes when they cover ``desc`` at ``chunk_bytes`` (they are
    recorded at the standard chunk size only); None: the push computes them."""
    if hashes is None or chunk_bytes != HASH_CHUNK_BYTES:
        return None
    try:
        plan_chunks(desc, hashes.sha256, chunk_bytes)
    except ReplicaError:
        return None
    return hashes
