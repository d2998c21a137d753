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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_agent.records import Json

__all__ = ["InplaceChoice", "ShmOffer", "all_usable", "choose_inplace"]


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

    def to_json(self) -> Json:
        return [self.step, self.token, self.seq, self.world_size, self.epoch]

    @classmethod
    def from_json(cls, v: Json) -> ShmOffer:
        if not isinstance(v, list) or len(v) != 5:
            raise ValueError(f"not a shared-memory offer: {v!r}")
        step, token, seq, ws, epoch = v
        return cls(int(str(step)), str(token), int(str(seq)), int(str(ws)), int(str(epoch)))


@dataclass(frozen=True)
class InplaceChoice:
    """The save every rank restores from memory (``token`` None: every rank uses storage)."""

    token: str | None
    step: int
    seqs: tuple[int, ...] = ()
    """Each rank's snapshot (its sequence number in its own area), in rank order."""
    reason: str = ""


def choose_inplace(
    offers: Sequence[Sequence[ShmOffer]],
    *,
    storage_step: int,
    world_size: int,
    allowed: bool = True,
    why_not: str = "",
) -> InplaceChoice:
    """The newest save offered by every rank, at least as new as storage's newest checkpoint.

    ``offers``: per rank, in rank order (every rank must be there). ``storage_step``: the
    newest committed step with weights that is not corrupted or expired (-1: none).
    ``allowed``: False when the coordinator was told to resume from something else
    (``CKPT_RESUME_FROM``, a manual recovery request: ``why_not`` says which).
    """
    if not allowed:
        return InplaceChoice(None, -1, reason=why_not or "a resume source was requested")
    if len(offers) != world_size or world_size < 1:
        return InplaceChoice(
            None, -1, reason=f"{len(offers)} ranks answered, the world has {world_size}"
        )
    by_rank: list[dict[str, ShmOffer]] = [{o.token: o for o in rank} for rank in offers]
    tokens = sorted(
        set.intersection(*(set(r) for r in by_rank)),
        key=lambda t: (by_rank[0][t].step, by_rank[0][t].seq),
        reverse=True,
    )
    if not tokens:
        missing = [r for r, rank in enumerate(offers) if not rank]
        what = f"ranks {missing} have none" if missing else "no save is in every rank's memory"
        return InplaceChoice(None, -1, reason=f"no shared-memory snapshot usable: {what}")
    for token in tokens:
        parts = [r[token] for r in by_rank]
        first = parts[0]
        if any(p.step != first.step or p.epoch != first.epoch for p in parts):
            continue  # one token, different steps or lineages: never mix, look further back
        if any(p.world_size != world_size for p in parts):
            continue  # taken at another world size: storage reshards, memory does not
        if first.step < storage_step:
            return InplaceChoice(
                None,
                -1,
                reason=f"storage holds a newer checkpoint (step {storage_step}) than every "
                f"rank's memory (step {first.step})",
            )
        return InplaceChoice(
            token,
            first.step,
            tuple(p.seq for p in parts),
            reason=f"step {first.step} is in every rank's memory "
            f"(storage newest step {storage_step})",
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
