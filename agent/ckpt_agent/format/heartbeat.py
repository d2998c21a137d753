"""The L0 heartbeat ring: one small object per rank, newest entries last.

A heartbeat records where the run was (step, epoch, data position, RNG),
not its weights; the object stays below ``HEARTBEAT_MAX_BYTES`` by dropping
the oldest entries. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import (
    FORMAT_HEARTBEAT,
    FORMAT_VERSION,
    HEARTBEAT_MAX_BYTES,
    dumps,
    heartbeat_key,
    loads,
)
from ckpt_agent.format.schema import nonneg_field, required_field
from ckpt_agent.records import Json
from ckpt_agent.storage.base import NotFoundError, Storage

__all__ = ["Heartbeat", "encode_heartbeats", "read_heartbeat"]


@dataclass(frozen=True)
class Heartbeat:
    """One L0 heartbeat: where the run was (step, epoch, data position, RNG)."""

    step: int
    time: float
    epoch: int | None = None
    data: Json = None
    """Tagged-JSON data position (:mod:`ckpt_agent.format.jsontree`)."""
    rng: Json = None
    """Tagged-JSON RNG states."""

    def to_json(self) -> dict[str, Json]:
        return {
            "step": self.step,
            "time": self.time,
            "epoch": self.epoch,
            "data": self.data,
            "rng": self.rng,
        }

    @classmethod
    def from_json(cls, d: Json, what: str) -> Heartbeat:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: heartbeat entry is not an object")
        epoch = d.get("epoch")
        return cls(
            step=nonneg_field(d.get("step"), f"{what}.step"),
            time=float(required_field(d, "time", (int, float), what)),
            epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            data=d.get("data"),
            rng=d.get("rng"),
        )


def encode_heartbeats(run_id: str, rank: int, entries: Sequence[Heartbeat]) -> bytes:
    """The heartbeat object (newest last), dropping the oldest entries to stay < 512 KB."""
    items = list(entries)
    while True:
        data = dumps(
            {
                "format": FORMAT_HEARTBEAT,
                "version": FORMAT_VERSION,
                "run_id": run_id,
                "rank": rank,
                "entries": [e.to_json() for e in items],
            }
        )
        if len(data) < HEARTBEAT_MAX_BYTES or len(items) <= 1:
            if len(data) >= HEARTBEAT_MAX_BYTES:
                raise ValueError(
                    f"one heartbeat is {len(data)} bytes, over the {HEARTBEAT_MAX_BYTES} limit: "
                    "keep the data position small (ids and offsets, not data)"
                )
            return data
        items = items[1:]


def read_heartbeat(storage: Storage, run_id: str, rank: int = 0) -> list[Heartbeat]:
    """The heartbeat ring of one rank, oldest first (empty when there is none)."""
    try:
        raw = storage.read(heartbeat_key(run_id, rank), 0, HEARTBEAT_MAX_BYTES + 1)
    except NotFoundError:
        return []
    d = loads(raw, "heartbeat", HEARTBEAT_MAX_BYTES)
    if d.get("format") != FORMAT_HEARTBEAT:
        raise CheckpointFormatError("heartbeat: wrong format")
    entries = d.get("entries") or []
    if not isinstance(entries, list):
        raise CheckpointFormatError("heartbeat: entries must be a list")
    return [Heartbeat.from_json(e, "heartbeat") for e in entries]
