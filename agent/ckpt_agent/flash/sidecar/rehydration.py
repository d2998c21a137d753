"""The sidecar's side of rehydration: answer a restarted trainer's request for its rank's
snapshot with the newest replica held on this node or by a peer
(:mod:`ckpt_agent.flash.replica.rehydrate` has the protocol).

:class:`Rehydration` runs in the sidecar's loop, after discovery: a request is answered
once (its nonce remembered), in the loop's own thread — while a replica is fetched the
other areas wait, which at a restart is nothing. The peers asked are every peer this
sidecar's replication named (``Replicator.named_peers``: the operator's peer map, which
keeps a rank's peers when it is recreated elsewhere, and the webhook's ring, which held the
replicas before the map existed). Every way of not finding one (replication off, no peer
holds it, a peer unreachable or its replica corrupted) is an answer with the reason, never
an error: the trainer then resumes as it would have without it. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ckpt_agent import tuning
from ckpt_agent.errors import PeerUnreachableError, ReplicaError
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.flash.replica.fetch import fetch, list_replicas, open_local
from ckpt_agent.flash.replica.marks import HeldMark, fetch_mark
from ckpt_agent.flash.replica.rehydrate import (
    Held,
    RehydrateAnswer,
    Slot,
    check_fits,
    free_slot,
    install,
    newest_held,
    publish,
    read_answer,
    read_request,
    write_answer,
)
from ckpt_agent.flash.replica.replicator import Replicator
from ckpt_agent.flash.sidecar.discovery import Areas, AreaState
from ckpt_agent.flash.step_heartbeat import install_record, read_step_heartbeat
from ckpt_agent.text import clean

__all__ = ["Rehydration"]

log = logging.getLogger(__name__)


class Rehydration:
    """Answers the rehydrate requests of the areas this sidecar serves."""

    def __init__(self, replicator: Replicator | None, emit: Callable[..., Any]) -> None:
        self.replicator = replicator
        self.emit = emit
        self._answered: dict[int, str] = {}
        """rank → the nonce answered last."""

    def poll(self, areas: Areas) -> int:
        """Answer every new request; returns how many were answered."""
        done = 0
        for rank, st in sorted(areas.states.items()):
            if not st.claimed:
                continue
            nonce = read_request(st.reader)
            if nonce is None or self._answered.get(rank) == nonce:
                continue
            self._answered[rank] = nonce
            if read_answer(st.reader, nonce) is not None:  # answered before this sidecar restarted
                continue
            answer = self._answer(st, rank, nonce)
            mark = self._restore_mark(st, rank)
            if mark:
                answer = replace(answer, why=f"{answer.why}; {mark}")
            if answer.found and answer.seq is not None:
                st.handled_seq = max(st.handled_seq, answer.seq)  # never persisted from here
            write_answer(st.reader, answer)
            self.emit(
                "rehydrated" if answer.found else "rehydrate_none",
                rank=rank,
                step=answer.step,
                source=answer.source,
                why=answer.why,
            )
            log.info("rehydration of rank %d: %s", rank, clean(answer.why))
            done += 1
        return done

    def _answer(self, st: AreaState, rank: int, nonce: str) -> RehydrateAnswer:
        rep = self.replicator
        if rep is None:
            return RehydrateAnswer(nonce, False, "peer replication is off on this node")
        if st.reader.latest() is not None:
            return RehydrateAnswer(nonce, False, "the area holds a snapshot already")
        notes: list[str] = []
        listed: list[tuple[Peer | None, Mapping[str, object]]] = [
            (None, {"source": r.source, "rank": r.rank, "step": r.desc.step, "seq": r.desc.seq})
            for r in rep.store.replicas()
            if r.rank == rank
        ]
        timeout_s = min(rep.options.timeout_s, tuning.REHYDRATE_LIST_TIMEOUT_S)
        ask = rep.named_peers()
        retry_until = time.monotonic() + tuning.REHYDRATE_REFUSED_RETRY_S
        while ask:
            refused: list[Peer] = []
            for peer in ask:
                try:
                    found = list_replicas(peer, rep.scope, timeout_s=timeout_s)
                except PeerUnreachableError as e:
                    if e.refused and time.monotonic() < retry_until:
                        refused.append(peer)  # its sidecar may be starting: ask again
                    else:
                        notes.append(f"peer {peer}: {clean(e)}")
                    continue
                except (ReplicaError, OSError) as e:
                    notes.append(f"peer {peer}: {clean(e)}")
                    continue
                listed += [(peer, e) for e in found]
            ask = refused
            if ask:
                time.sleep(0.2)
        for held in newest_held(listed, rank):
            where = "this node's store" if held.peer is None else f"peer {held.peer}"
            try:
                desc = self._install(st, held)
            except (ReplicaError, OSError, ValueError) as e:
                notes.append(f"the replica of step {held.step} in {where}: {clean(e)}")
                continue
            return RehydrateAnswer(
                nonce,
                True,
                f"step {desc.step} from {where} (taken on node {held.source})",
                step=desc.step,
                seq=desc.seq,
                source=held.source,
            )
        if not notes:
            notes.append(f"no replica of rank {rank} on this node or its peers")
        return RehydrateAnswer(nonce, False, "; ".join(notes))

    def _restore_mark(self, st: AreaState, rank: int) -> str:
        """The rank's step heartbeat (JIT saves) back into its new area: the newest record
        held here or by a peer; what was done, for the answer ("" when replication is off
        or the area has its own)."""
        rep = self.replicator
        if rep is None or read_step_heartbeat(st.reader.dir) is not None:
            return ""
        found: list[tuple[str, HeldMark]] = []
        own = rep.mark_store.newest(rank)
        if own is not None:
            found.append(("this node's store", own))
        timeout_s = min(rep.options.timeout_s, tuning.REHYDRATE_LIST_TIMEOUT_S)
        for peer in rep.named_peers():
            try:
                held = fetch_mark(peer, rep.scope, rank, timeout_s=timeout_s)
            except (ReplicaError, OSError) as e:
                log.info("no step heartbeat of rank %d from %s: %s", rank, peer, clean(e))
                continue
            if held is not None:
                found.append((f"peer {peer}", held))
        if not found:
            return "no step heartbeat of this rank on this node or its peers"
        where, newest = max(found, key=lambda f: f[1].record.heartbeat.time)
        try:
            record = install_record(st.reader.dir, newest.raw)
        except (OSError, ValueError) as e:
            return f"the step heartbeat from {where} could not be installed: {clean(e)}"
        self.emit("step_mark_restored", rank=rank, step=record.heartbeat.step, source=where)
        return f"step heartbeat of step {record.heartbeat.step} from {where}"

    def _install(self, st: AreaState, held: Held) -> Descriptor:
        rep = self.replicator
        assert rep is not None
        rank = st.reader.rank
        if held.peer is None:
            with open_local(rep.store, held.source, rank) as replica:
                return install(st.reader, replica)
        with contextlib.ExitStack() as stack:
            slots: list[Slot] = []

            def into(desc: Descriptor) -> memoryview:  # straight into a slot: no copy
                check_fits(st.reader, desc)
                slots.append(stack.enter_context(free_slot(st.reader, desc.data_size)))
                return slots[0].view

            replica = fetch(
                held.peer,
                rep.scope,
                held.source,
                rank,
                run_id=st.reader.run_id,
                max_bytes=rep.options.max_snapshot_bytes,
                timeout_s=rep.options.timeout_s,
                into=into,
            )
            return publish(st.reader, slots[0], replica)
