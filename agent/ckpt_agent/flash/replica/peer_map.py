"""Which peers this sidecar pushes to: the operator's rack/zone-aware choice over the ring.

The webhook gives the sidecar a ring of peers at admission (``CKPT_REPLICA_PEERS``), before
the pod has a node. Once every pod of the job is scheduled the operator publishes its
choice (docs/replicas.md, "Peers"): the ConfigMap ``ckpt-replica-peers-<job>``, mounted
into the sidecar as a folder with one file per rank (``rank-<r>``: ``host:port,…``; the
kubelet refreshes the files when the ConfigMap changes, which is why it is no ``subPath``).

:class:`PeerMap` reads this rank's file every ``refresh_s`` and answers the peers to push
to: the file's while it is there and well formed, else the ring. A missing file (the
ConfigMap not published yet, or an operator that does not publish it) and a malformed one
are logged once per change of state, never an error. :attr:`PeerMap.named` keeps every
peer named so far (the map's, the ring's, earlier maps'): a rank recreated on another
node asks all of them for its replica. Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.text import clean

__all__ = ["DEFAULT_REFRESH_S", "MAX_MAP_BYTES", "PeerMap", "parse_peers"]

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S: Final = 10.0
"""How often the sidecar reads its peer map (the kubelet refreshes a ConfigMap volume
within about a minute of a change)."""
MAX_MAP_BYTES: Final = 64 * 1024
"""A rank's file past this is malformed (three peers take under a kilobyte)."""


def parse_peers(raw: str, what: str) -> tuple[Peer, ...]:
    """Comma-separated ``host:port`` (``[v6]:port`` for IPv6; blanks ignored) as peers.

    Raises ValueError naming ``what`` (the variable or file) for a peer that is not
    ``host:port`` or one named twice."""
    peers: list[Peer] = []
    for item in (p.strip() for p in raw.split(",")):
        if not item:
            continue
        try:
            peers.append(Peer.parse(item))
        except ValueError:
            raise ValueError(
                f"{what}: {clean(item, 80)!r} is not host:port ([v6]:port for IPv6); "
                "expected a comma-separated list of the peer sidecars"
            ) from None
    if len(set(peers)) != len(peers):
        raise ValueError(f"{what}={clean(raw, 80)!r} names a peer twice")
    return tuple(peers)


class PeerMap:
    """This sidecar's peers: the map file's (``file``) over the ring (see the module doc).

    Not thread-safe on its own: one thread (the pusher) calls :meth:`refresh`; the others
    read :attr:`peers` and :attr:`named`, which are replaced whole, never changed in place.
    """

    def __init__(
        self,
        ring: Sequence[Peer],
        file: str | Path | None = None,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ring = tuple(ring)
        self.file = Path(file) if file is not None else None
        self.refresh_s = refresh_s
        self.clock = clock
        self.peers: tuple[Peer, ...] = self.ring
        """The peers to push to now."""
        self.source = "ring"
        """Where :attr:`peers` come from: ``ring`` or ``map``."""
        self.named: tuple[Peer, ...] = self.ring
        """Every peer named so far, the current ones first."""
        self._state: object = None
        self._next = 0.0
        if self.file is not None:
            self.refresh(force=True)

    def due_in(self) -> float | None:
        """Seconds until the next read is due (0: now; None: there is no map to read)."""
        if self.file is None:
            return None
        return max(0.0, self._next - self.clock())

    def refresh(self, *, force: bool = False) -> bool:
        """Read the map when due (``force``: now); True when the peers changed."""
        if self.file is None or (not force and self.clock() < self._next):
            return False
        self._next = self.clock() + self.refresh_s
        chosen, source = self._read(self.file)
        if chosen == self.peers and source == self.source:
            return False
        self.peers, self.source = chosen, source
        self.named = tuple(dict.fromkeys([*chosen, *self.named, *self.ring]))
        log.info(
            "peer replication pushes to %s (%s)",
            ", ".join(map(str, chosen)) or "no peer",
            "the operator's peer map" if source == "map" else "the ring of CKPT_REPLICA_PEERS",
        )
        return True

    def _read(self, file: Path) -> tuple[tuple[Peer, ...], str]:
        try:
            with file.open("rb") as f:
                data = f.read(MAX_MAP_BYTES + 1)
        except FileNotFoundError:
            self._once(("missing",), logging.INFO, f"no peer map {file} (yet): pushing to the ring")
            return self.ring, "ring"
        except OSError as e:
            self._once(("unreadable", str(e)), logging.WARNING,
                       f"cannot read the peer map {file}: {e}; pushing to the ring")  # fmt: skip
            return self.ring, "ring"
        try:
            if len(data) > MAX_MAP_BYTES:
                raise ValueError(f"{file} is larger than {MAX_MAP_BYTES} bytes")
            peers = parse_peers(data.decode("utf-8"), str(file))
            if not peers:
                raise ValueError(f"{file} names no peer")
        except (UnicodeDecodeError, ValueError) as e:
            self._once(("malformed", data), logging.ERROR,
                       f"the peer map is malformed, pushing to the ring: {e}")  # fmt: skip
            return self.ring, "ring"
        self._state = ("map", peers)
        return peers, "map"

    def _once(self, state: object, level: int, message: str) -> None:
        """Log ``message`` when the map's state changed since the last read."""
        if state != self._state:
            self._state = state
            log.log(level, "%s", clean(message, 400))
