"""Which rank areas the sidecar serves, whose trainer is alive, what is pending.

:class:`Areas` finds the rank areas under ``$CKPT_SHM_DIR/<run>/`` (or serves the
ranks it was told to), claims each one (one persister per area), follows each
trainer's liveness lock and lists the newest complete snapshot not handled yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.persist.finalize import EventSink
from ckpt_agent.records import Json

__all__ = ["AreaState", "Areas"]

log = logging.getLogger(__name__)


@dataclass
class AreaState:
    """One rank's area as the sidecar sees it."""

    reader: ShmReader
    claimed: bool = False
    seen_alive: bool = False
    alive: bool = False
    handled_seq: int = 0


class Areas:
    """The rank areas of one run (see the module doc)."""

    def __init__(
        self,
        shm_dir: Path,
        run_id: str,
        metrics: SidecarMetrics,
        emit: EventSink,
        *,
        ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.shm_dir = shm_dir
        self.run_id = run_id
        self.metrics = metrics
        self.emit = emit
        self.wanted = ranks
        self.states: dict[int, AreaState] = {}

    def __getitem__(self, rank: int) -> AreaState:
        return self.states[rank]

    def __iter__(self) -> Iterator[AreaState]:
        return iter(self.states.values())

    def __len__(self) -> int:
        return len(self.states)

    def discover(self) -> None:
        """Pick up new areas, claim unclaimed ones, follow each trainer's liveness."""
        ranks = set(ShmArea.ranks(self.shm_dir, self.run_id))
        if self.wanted is not None:
            ranks = set(self.wanted)
        for r in sorted(ranks):
            if r not in self.states:
                reader = ShmReader(self.shm_dir, self.run_id, r)
                state = AreaState(reader=reader)
                mark = reader.persisted()
                state.handled_seq = mark.seq if mark is not None else 0
                self.states[r] = state
        for r, st in self.states.items():
            if not st.claimed:
                st.claimed = st.reader.claim()
                if st.claimed:
                    self.emit("serving", rank=r)
            alive = st.reader.trainer_alive()
            if alive and not st.alive:
                self.emit("trainer_up", rank=r)
            if st.alive and not alive:
                self.metrics.trainer_deaths.inc()
                self.emit("trainer_died", rank=r)
                log.warning("trainer of rank %d died: persisting its newest complete snapshot", r)
            st.alive = alive
            st.seen_alive = st.seen_alive or alive
            self.metrics.trainer_alive.labels(rank=str(r)).set(1 if alive else 0)

    def pending(self) -> list[tuple[int, Descriptor]]:
        """Areas with a complete snapshot not handled yet (newest per area; but a durable
        save not handled yet goes before a newer memory-only one — a memory-tier snapshot or
        a just-in-time save — which never reaches storage: the durable save still commits)."""
        out = []
        for r, st in sorted(self.states.items()):
            if not st.claimed:
                continue
            todo = [d for d in st.reader.complete() if d.seq > st.handled_seq]
            if not todo:
                continue
            durable = [d for d in todo if not d.memory_only]
            newest = todo[-1]
            out.append((r, durable[-1] if newest.memory_only and durable else newest))
        return out

    def any_alive(self) -> bool:
        return any(st.alive for st in self.states.values())

    def trainer_was_here(self) -> bool:
        """A trainer was seen alive, or created its lock, in some area."""
        return any(
            st.seen_alive or (st.reader.dir / "trainer.lock").exists()
            for st in self.states.values()
        )

    def summary(self) -> dict[str, Json]:
        return {
            str(r): {"trainer_alive": st.alive, "handled_seq": st.handled_seq}
            for r, st in self.states.items()
        }

    def release(self) -> None:
        for st in self.states.values():
            st.reader.release()
