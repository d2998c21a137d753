"""Pickle-free collectives over one ``torch.distributed`` process group (:class:`Comm`).

The agreement (:mod:`.agreement`) and the two-phase commit (:mod:`.commit`) run on
tensor collectives only: ``torch.distributed``'s object collectives pickle, so every
message here is a JSON document carried in a ``uint8`` tensor, or a float64 vector.
:class:`LocalComm` is the trivial world of one rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from ckpt_agent import tuning
from ckpt_agent.errors import DistributedError
from ckpt_agent.records import Json

__all__ = ["Comm", "LocalComm", "encode_json"]


class Comm:
    """Pickle-free collectives over one process group (bytes, JSON, float64 rows).

    Create it with :meth:`new_group` on every rank in the same order (it is a
    collective call); each :class:`Comm` owns its own gloo group, so one
    thread may use it while another thread uses a different one.
    """

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def new_group(cls, *, timeout_s: float | None = None) -> Comm:
        """A new gloo group over the default world (collective: every rank calls it);
        ``timeout_s`` None: :data:`~ckpt_agent.tuning.DIST_TIMEOUT_S`."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(
                "torch.distributed is not initialized: call init_process_group() before "
                "creating a Checkpointer with world_size > 1"
            )
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=tuning.DIST_TIMEOUT_S if timeout_s is None else timeout_s)
        )
        return cls(group, dist.get_rank(), dist.get_world_size())

    # ------------------------------------------------------------------ primitives

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, t, group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"all_gather failed (a rank died or hung?): {e}") from e
        return out

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast(t, src=self._global(src), group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"broadcast failed (a rank died or hung?): {e}") from e

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return int(dist.get_global_rank(self.group, group_rank))

    def barrier(self) -> None:
        self.all_gather_f64([0.0])

    # ------------------------------------------------------------------ typed helpers

    def all_gather_f64(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's vector (same length on all ranks), in rank order."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        return [r.tolist() for r in self._all_gather(t)]

    def all_gather_bytes(self, data: bytes, *, fixed: int | None = None) -> list[bytes]:
        """Every rank's bytes, in rank order.

        With ``fixed`` one collective of ``fixed + 8`` bytes per rank (the
        message must fit); otherwise the lengths are gathered first.
        """
        if fixed is not None:
            if len(data) > fixed:
                raise ValueError(f"message of {len(data)} bytes exceeds the fixed size {fixed}")
            buf = torch.zeros(fixed + 8, dtype=torch.uint8)
            buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if data:
                buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            rows = self._all_gather(buf)
            out = []
            for r in rows:
                n = int(r[:8].clone().view(torch.int64).item())
                if not 0 <= n <= fixed:
                    raise DistributedError(f"garbled message length {n}")
                out.append(bytes(r[8 : 8 + n].numpy().tobytes()))
            return out
        lengths = self._all_gather(torch.tensor([len(data)], dtype=torch.int64))
        size = max(int(n.item()) for n in lengths)
        buf = torch.zeros(max(size, 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self._all_gather(buf)
        return [
            bytes(r[: int(n.item())].numpy().tobytes()) for r, n in zip(rows, lengths, strict=True)
        ]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``src``'s bytes on every rank (other ranks pass None)."""
        if self.rank == src and data is None:
            raise ValueError("the source rank must pass data")
        n = torch.tensor([len(data) if self.rank == src and data is not None else 0])
        self._broadcast(n, src)
        size = int(n.item())
        buf = torch.zeros(max(size, 1), dtype=torch.uint8)
        if self.rank == src and data:
            buf[:size] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._broadcast(buf, src)
        return bytes(buf[:size].numpy().tobytes())

    def all_gather_json(self, obj: Json, *, fixed: int | None = None) -> list[Json]:
        rows = self.all_gather_bytes(encode_json(obj), fixed=fixed)
        return [json.loads(r) for r in rows]

    def broadcast_tensor(self, t: torch.Tensor, src: int = 0) -> None:
        """``src``'s tensor into ``t`` on every rank (same shape and dtype everywhere)."""
        self._broadcast(t, src)

    def broadcast_json(self, obj: Json, src: int = 0) -> Json:
        data = encode_json(obj) if self.rank == src else None
        return json.loads(self.broadcast_bytes(data, src))


class LocalComm(Comm):
    """The trivial world of one rank (no torch.distributed needed)."""

    def __init__(self) -> None:
        super().__init__(None, 0, 1)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        del t, src

    def _global(self, group_rank: int) -> int:
        return group_rank


def encode_json(obj: Json) -> bytes:
    """The canonical, NaN-free JSON bytes every message of the agent's collectives carries."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
