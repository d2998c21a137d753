"""The sidecar relays each rank's step heartbeat to the replica peers (JIT saves, #31).

With ``jitSave`` a trainer records every step's RNG and data position in its area
(:mod:`ckpt_agent.flash.step_heartbeat`); that survives the process, not the node. With
peer replication on, :class:`StepMarkRelay` runs in the sidecar's loop: it reads the two
record headers of each area it serves (two small reads), and when the sequence number
moved, hands the newest whole record to the replicator, whose own thread pushes it to the
peers (:class:`~ckpt_agent.flash.replica.marks.MarkRelay`). A rank recreated on another
node gets it back with its replica (:mod:`.rehydration`). Records written faster than the
loop polls are coalesced: only the newest matters. Torch-free.
"""

from __future__ import annotations

from ckpt_agent.flash.replica.replicator import Replicator
from ckpt_agent.flash.sidecar.discovery import Areas
from ckpt_agent.flash.step_heartbeat import newest_record, peek_seq

__all__ = ["StepMarkRelay"]


class StepMarkRelay:
    """Hands new step heartbeat records of the served areas to the replicator."""

    def __init__(self, replicator: Replicator) -> None:
        self.replicator = replicator
        self._seen: dict[int, int] = {}
        """rank → the sequence number relayed last."""
        self.relayed = 0

    def poll(self, areas: Areas) -> int:
        """Relay every area's record that is new since the last poll; returns how many."""
        done = 0
        for rank, st in areas.states.items():
            if not st.claimed:
                continue
            seq = peek_seq(st.reader.dir)
            if seq == 0 or seq == self._seen.get(rank):
                continue
            raw = newest_record(st.reader.dir)
            if raw is None:
                continue  # being written: the next poll reads it whole
            self._seen[rank] = seq
            self.replicator.offer_mark(rank, raw)
            done += 1
        self.relayed += done
        return done
