"""In-place restarts from shared memory: which snapshot every rank restores, or none.

After a process crash on a node that survives, each rank's shared-memory area
may still hold its snapshots. A resume from memory must be exactly-once and
never a mix: every rank restores its part of the *same save* (one save token),
or every rank resumes from storage. :func:`choose_inplace` makes that choice
from what each rank offers (complete snapshots with recorded hashes, not yet
checked) and what storage holds; every rank runs it on the same gathered
inputs, so every rank gets the same answer. :func:`all_usable` is the second
round: after each rank checked its snapshot, one failure anywhere sends every
rank to storage. Pure: no I/O.

A *just-in-time* save (``jit``, docs/replicas.md) is the one save some ranks may lack:
the survivors of a rank that died mid-step each wrote the last completed step with the
whole replicated state. It is usable when every rank without it recorded that very step
in the same lineage (its step heartbeat: :class:`StepMark`), which gives that rank its
RNG and data position; the replicated state comes from the first rank holding the save
(:attr:`InplaceChoice.source`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_agent.records import Json

__all__ = ["InplaceChoice", "ShmOffer", "StepMark", "all_usable", "choose_inplace"]


@dataclass(frozen=True)
class ShmOffer:
    """One complete snapshot in a rank's area (its hashes recorded, its bytes not yet checked)."""

    step: int
    token: str
    """The save token: the same on every rank's part of one save, unique per save."""
    seq: int
    world_size: int
    epoch: int = 0
    """The resume lineage epoch the snapshot was taken in."""
    jit: bool = False
    """A just-in-time save: the whole replicated state, written without the other ranks."""

    def to_json(self) -> Json:
        return [self.step, self.token, self.seq, self.world_size, self.epoch, self.jit]

    @classmethod
    def from_json(cls, v: Json) -> ShmOffer:
        if not isinstance(v, list) or len(v) not in (5, 6):
            raise ValueError(f"not a shared-memory offer: {v!r}")
        step, token, seq, ws, epoch = v[:5]
        jit = len(v) == 6 and v[5] is True
        return cls(int(str(step)), str(token), int(str(seq)), int(str(ws)), int(str(epoch)), jit)


@dataclass(frozen=True)
class StepMark:
    """The newest step a rank recorded in its step heartbeat, and its lineage epoch."""

    step: int
    epoch: int

    def to_json(self) -> Json:
        return [self.step, self.epoch]

    @classmethod
    def from_json(cls, v: Json) -> StepMark | None:
        if not isinstance(v, list) or len(v) != 2:
            return None
        return cls(int(str(v[0])), int(str(v[1])))


@dataclass(frozen=True)
class InplaceChoice:
    """The save every rank restores from memory (``token`` None: every rank uses storage)."""

    token: str | None
    step: int
    seqs: tuple[int, ...] = ()
    """Each rank's snapshot (its sequence number in its own area), in rank order (-1: a
    rank restored from its step heartbeat)."""
    reason: str = ""
    source: int = 0
    """The rank whose snapshot holds the replicated state (rank 0 but for a JIT save)."""
    from_heartbeat: tuple[int, ...] = ()
    """Ranks whose RNG and data position come from their step heartbeat (a JIT save)."""


def choose_inplace(
    offers: Sequence[Sequence[ShmOffer]],
    *,
    storage_step: int,
    world_size: int,
    allowed: bool = True,
    why_not: str = "",
    marks: Sequence[StepMark | None] | None = None,
) -> InplaceChoice:
    """The newest save offered by every rank, at least as new as storage's newest checkpoint.

    ``offers``: per rank, in rank order (every rank must be there). ``storage_step``: the
    newest committed step with weights that is not corrupted or expired (-1: none).
    ``allowed``: False when the coordinator was told to resume from something else
    (``CKPT_RESUME_FROM``, a manual recovery request: ``why_not`` says which). ``marks``:
    per rank, its step heartbeat (None: none), which stands in for a JIT save it lacks.
    """
    if not allowed:
        return InplaceChoice(None, -1, reason=why_not or "a resume source was requested")
    if len(offers) != world_size or world_size < 1:
        return InplaceChoice(
            None, -1, reason=f"{len(offers)} ranks answered, the world has {world_size}"
        )
    by_rank: list[dict[str, ShmOffer]] = [{o.token: o for o in rank} for rank in offers]
    mark_of = list(marks) if marks is not None and len(marks) == world_size else []
    held: dict[str, list[int]] = {}
    for r, rank in enumerate(by_rank):
        for token in rank:
            held.setdefault(token, []).append(r)

    def first(token: str) -> ShmOffer:
        return by_rank[held[token][0]][token]

    def covered(token: str) -> bool:
        """Every rank holds it, or it is a JIT save and every rank without it marked its step."""
        if len(held[token]) == world_size:
            return True
        o = first(token)
        return (
            o.jit
            and bool(mark_of)
            and all(
                token in by_rank[r] or mark_of[r] == StepMark(o.step, o.epoch)
                for r in range(world_size)
            )
        )

    tokens = sorted(
        (t for t in held if covered(t)),
        key=lambda t: (first(t).step, first(t).seq),
        reverse=True,
    )
    if not tokens:
        missing = [r for r, rank in enumerate(offers) if not rank]
        what = f"ranks {missing} have none" if missing else "no save is in every rank's memory"
        return InplaceChoice(None, -1, reason=f"no shared-memory snapshot usable: {what}")
    for token in tokens:
        holders = held[token]
        parts = [by_rank[r][token] for r in holders]
        head = parts[0]
        if any(p.step != head.step or p.epoch != head.epoch for p in parts):
            continue  # one token, different steps or lineages: never mix, look further back
        if any(p.world_size != world_size for p in parts):
            continue  # taken at another world size: storage reshards, memory does not
        if head.step < storage_step:
            return InplaceChoice(
                None,
                -1,
                reason=f"storage holds a newer checkpoint (step {storage_step}) than every "
                f"rank's memory (step {head.step})",
            )
        rest = tuple(r for r in range(world_size) if r not in holders)
        seqs = tuple(by_rank[r][token].seq if r in holders else -1 for r in range(world_size))
        if rest:
            reason = (
                f"step {head.step}: a just-in-time save by ranks {holders}, ranks {list(rest)} "
                f"from their step heartbeat (storage newest step {storage_step})"
            )
        else:
            reason = (
                f"step {head.step} is in every rank's memory (storage newest step {storage_step})"
            )
        return InplaceChoice(
            token, head.step, seqs, reason=reason, source=holders[0], from_heartbeat=rest
        )
    return InplaceChoice(
        None, -1, reason="the saves every rank holds disagree (step, lineage or world size)"
    )


def all_usable(reports: Sequence[Mapping[str, Json]]) -> tuple[bool, str]:
    """Second round: every rank checked its snapshot (``{"ok": bool, "why": str}`` each).

    Returns (every rank ok, why not: the first failing ranks' reasons).
    """
    bad = [(r, str(rep.get("why") or "")) for r, rep in enumerate(reports) if not rep.get("ok")]
    if not bad:
        return True, ""
    return False, "; ".join(f"rank {r}: {why}" for r, why in bad[:4])
