"""Resume lineages: a resume pin is applied once, then its lineage continues (pure, no I/O).

A *pin* names the checkpoint the next start must resume from: the
operator's ``CKPT_RESUME_FROM`` (every pod of a restarted job carries it, for
the job's whole life) or a person's ``RECOVER.json`` request (``ckpt recover``).
Applying a pin rewinds the run to it and opens a new *lineage*
(:class:`~ckpt_agent.records.Lineage`: an ``epoch`` one above every epoch in
storage, and the keys of the pins it honours); every checkpoint written
afterwards carries that lineage in its manifest, and a later resume that
follows the ladder continues the lineage of the checkpoint it resumed.

The rule (:func:`choose`), with no wall clock, the same after any process or
operator restart:

* the *current lineage* is the lineage of the newest valid weights
  checkpoint (a pin application retires everything newer than the pin, so
  the live checkpoints always form one history and the newest one carries
  the newest lineage);
* a pin whose key the current lineage honours is **spent**: the run already
  committed a valid checkpoint that descends from it. It is not applied
  again; the ladder resumes from the newest valid checkpoint of the current
  lineage (the pin itself and heartbeats stay as fallbacks; nothing older
  than the pin is offered). An in-place container restart of a pinned job,
  however often it happens, therefore continues instead of rewinding;
* a pin whose checkpoint is expired is spent too: a later resume abandoned
  it (a manual rewind past it, consumed, then a crash before the rewind's
  first commit) or retention released it; the ladder decides;
* otherwise the first unspent pin (a request before the operator's pin: a
  person asked later) is applied exactly, and the new lineage honours every
  pin in force, so the operator's pin stays spent after a manual rewind;
* a rewind that crashes before its first commit left no checkpoint of the
  new lineage: the pin is unspent and applies again (which is right);
* a corrupted (or deleted) pin does not matter once spent; before, applying
  it fails loudly.

Which checkpoints are retired (marked superseded) once the resume point is
known is :func:`superseded`: those newer than the resume point. When a pin is
spent the resume point is the newest valid checkpoint of its lineage, so
nothing valid it wrote is ever retired; only the branch a pin application
abandons is. A resume that followed the ladder retires only what it tried and
found unusable (and lightweight pulses, which the ladder ranks below an exact
resume), never a checkpoint it did not try (:func:`untried`): one odd checkpoint
whose chain points further back must not retire the valid ones it skips.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Json, Lineage

__all__ = [
    "LineageChoice",
    "Pin",
    "PinSource",
    "choose",
    "current_lineage",
    "env_pin",
    "pending_to_verify",
    "pins_in_force",
    "request_pin",
    "superseded",
    "untried",
]

PinSource = Literal["resume_from", "manual"]

#: Hex digits of a request's SHA-256 in its pin key.
_REQUEST_KEY_HEX = 16


@dataclass(frozen=True)
class Pin:
    """A resume pin: the checkpoint to resume from exactly, and its identity."""

    checkpoint_id: str
    key: str
    """What lineages record: ``CKPT_RESUME_FROM:<id>`` or ``RECOVER.json:<request hash>``."""
    source: PinSource
    weights_from: str | None = None
    """For a heartbeat: the checkpoint supplying the weights."""


def env_pin(checkpoint_id: str, weights_from: str | None = None, nonce: str | None = None) -> Pin:
    """The operator's ``CKPT_RESUME_FROM`` (the same key for every pod and restart of the
    job); ``weights_from``: its ``CKPT_RESUME_WEIGHTS`` (a heartbeat rebuild's weights);
    ``nonce``: its ``CKPT_RESUME_PIN`` (a manual restart: a new key, so a new pin even
    when the same checkpoint was pinned before)."""
    key = f"CKPT_RESUME_FROM:{checkpoint_id}" + (f"#{nonce}" if nonce else "")
    return Pin(checkpoint_id, key, "resume_from", weights_from)


def request_pin(checkpoint_id: str, raw: bytes, weights_from: str | None = None) -> Pin:
    """A ``RECOVER.json`` request (``raw``: its bytes; each request has its own key)."""
    digest = hashlib.sha256(raw).hexdigest()[:_REQUEST_KEY_HEX]
    return Pin(checkpoint_id, f"RECOVER.json:{digest}", "manual", weights_from)


def pins_in_force(
    request: Mapping[str, Json] | None,
    resume_from: str | None,
    resume_weights: str | None = None,
    resume_pin: str | None = None,
) -> list[Pin]:
    """The resume pins in force, the one to apply first first: a person's ``RECOVER.json``
    request (parsed; keyed by its canonical JSON), then the operator's ``CKPT_RESUME_FROM``
    (with ``CKPT_RESUME_WEIGHTS``, the weights of a heartbeat rebuild)."""
    pins: list[Pin] = []
    if request is not None:
        raw = json.dumps(request, sort_keys=True).encode()
        src = request.get("weights_from")
        pins.append(request_pin(str(request["checkpoint_id"]), raw, str(src) if src else None))
    if resume_from:
        pins.append(env_pin(resume_from, resume_weights or None, resume_pin or None))
    return pins


@dataclass(frozen=True)
class LineageChoice:
    """What :func:`choose` decided."""

    apply: Pin | None
    """Restore exactly this pin (None: walk the ladder)."""
    lineage: Lineage | None
    """The lineage the resumed run's checkpoints carry (its parent is set on restore);
    None: the resumed checkpoint's own."""
    candidates: frozenset[str] | None
    """The only checkpoints the ladder may use (None: any)."""
    spent: tuple[Pin, ...] = ()
    """Pins the current lineage already honours: not applied again."""
    reason: str = ""


def _newest_first(r: CheckpointRecord) -> tuple[int, int]:
    return (r.step, list(Tier).index(r.tier))


def current_lineage(records: Sequence[CheckpointRecord]) -> Lineage | None:
    """The lineage of the newest valid weights checkpoint (None: there is none)."""
    valid = [r for r in records if r.has_weights and r.status == CheckpointStatus.VALID]
    return max(valid, key=_newest_first).lineage if valid else None


def choose(records: Sequence[CheckpointRecord], pins: Sequence[Pin]) -> LineageChoice:
    """Apply a pin, continue the current lineage, or walk the ladder (see the module doc).

    ``pins``: the pins in force, the one to apply first first (a request, then the
    operator's pin).
    """
    current = current_lineage(records)
    honoured = current.pins if current is not None else ()
    expired = {r.id for r in records if r.status == CheckpointStatus.EXPIRED}
    spent = tuple(p for p in pins if p.key in honoured or p.checkpoint_id in expired)
    unspent = [p for p in pins if p not in spent]
    if unspent:
        pin = unspent[0]
        epoch = 1 + max((r.lineage.epoch for r in records), default=0)
        keys = tuple(dict.fromkeys([pin.key, *(p.key for p in pins)]))
        also = f" (already honoured: {', '.join(p.key for p in spent)})" if spent else ""
        return LineageChoice(
            apply=pin,
            lineage=Lineage(epoch=epoch, pins=keys),
            candidates=None,
            spent=spent,
            reason=f"{pin.key} not applied yet: resume exactly from {pin.checkpoint_id}, "
            f"lineage epoch {epoch}" + also,
        )
    if current is not None and any(p.key in honoured for p in spent):
        pinned = {p.checkpoint_id for p in spent}
        allowed = frozenset(
            r.id
            for r in records
            if r.lineage.same_lineage(current) or r.id in pinned or r.tier == Tier.HEARTBEAT
        )
        return LineageChoice(
            apply=None,
            lineage=Lineage(epoch=current.epoch, pins=current.pins),
            candidates=allowed,
            spent=spent,
            reason=f"{', '.join(p.key for p in spent)} already applied (lineage epoch "
            f"{current.epoch} has valid checkpoints): continue that lineage",
        )
    if spent:
        return LineageChoice(
            apply=None,
            lineage=None,
            candidates=None,
            spent=spent,
            reason=f"{', '.join(p.key for p in spent)} names an expired checkpoint (a later "
            "resume abandoned it, or retention released it): the ladder decides",
        )
    return LineageChoice(apply=None, lineage=None, candidates=None, reason="no resume pin")


def pending_to_verify(
    records: Sequence[CheckpointRecord], pins: Sequence[Pin], limit: int
) -> list[CheckpointRecord]:
    """Pending weights checkpoints to verify before :func:`choose`, newest first (at most
    ``limit``): those newer than the newest valid one (a crash between commit and
    validation must not make them unusable); with pins, only those that honour one
    (a pending checkpoint of another lineage would be retired, not resumed)."""
    newest_valid = max(
        (r.step for r in records if r.has_weights and r.status == CheckpointStatus.VALID),
        default=-1,
    )
    keys = {p.key for p in pins}
    pending = [
        r
        for r in records
        if r.status == CheckpointStatus.PENDING
        and r.has_weights
        and r.step > newest_valid
        and (not keys or keys.intersection(r.lineage.pins))
    ]
    return sorted(pending, key=_newest_first, reverse=True)[:limit]


def superseded(
    records: Sequence[CheckpointRecord], resumed_step: int, *, spare: Collection[str] = ()
) -> list[CheckpointRecord]:
    """The committed checkpoints a resume at ``resumed_step`` abandons: every stored
    (not heartbeat, not already corrupted or expired) one past it, except those in
    ``spare`` (a ladder's resume: :func:`untried`)."""
    gone = (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED)
    return [
        r
        for r in records
        if r.step > resumed_step
        and r.tier != Tier.HEARTBEAT
        and r.manifest_hash
        and r.status not in gone
        and r.id not in spare
    ]


def untried(
    records: Sequence[CheckpointRecord], resumed_step: int, tried: Collection[str]
) -> frozenset[str]:
    """What a resume that followed the ladder (no pin applied) must not retire: the
    checkpoints past ``resumed_step`` it could have resumed from but did not try — a
    valid complete weights checkpoint (or a pending one: not verified yet) absent from
    ``tried``. ``records``: the checkpoints the ladder was allowed to use.

    A ladder resume retires only what it tried and found unusable, and what the ladder
    ranks below the resume point by rule (a lightweight pulse: an exact resume comes
    first); a checkpoint never loses its place because of *another* checkpoint's
    verdict (an odd checkpoint whose chain points further back). The ladder offers
    newer checkpoints first (:func:`ckpt_agent.decide.recovery.plan_recovery`), so this
    is empty unless a checkpoint appeared, or stayed pending, past the ones it checked.
    """
    live = (CheckpointStatus.VALID, CheckpointStatus.PENDING)
    return frozenset(
        r.id
        for r in records
        if r.step > resumed_step
        and r.has_weights
        and not r.lightweight
        and r.status in live
        and r.id not in tried
    )
