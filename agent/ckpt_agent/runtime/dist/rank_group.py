"""Several ranks: the checkpointer's glue to :mod:`ckpt_agent.runtime.dist.agreement`.

:class:`RankGroup` creates the agent's own gloo groups (a control group for
the per-step agreement and broadcasts, a commit group for the two-phase
commit), runs the per-step agreement, and carries the restore side's collectives over
the control group: rank 0's resume choice, which every rank then restores
(:meth:`RankGroup.broadcast`; :mod:`~ckpt_agent.runtime.restore.agreed`), and the
in-place restart from shared memory (:meth:`RankGroup.gather`,
:meth:`RankGroup.broadcast_tensor`; :mod:`~ckpt_agent.runtime.shm.in_place`).
"""

from __future__ import annotations

import torch

from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.errors import CheckpointError
from ckpt_agent.records import Json
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.dist.agreement import Agreed, DecisionAgreement, LocalSignals
from ckpt_agent.runtime.dist.comm import Comm

__all__ = ["RankGroup"]


class RankGroup:
    """The agent's process groups and what the checkpointer does with them (collective calls)."""

    def __init__(self, engine: Engine, timeout_s: float | None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self._control: Comm | None = None
        self._commit: Comm | None = None
        self._agreement: DecisionAgreement | None = None

    def setup(self, *, control: Comm | None = None, commit: Comm | None = None) -> None:
        """Create the agent's gloo groups (collective, same order on every rank); or use
        the ``control`` and ``commit`` groups given (a test's, or a caller's own)."""
        ranks = self.engine.ranks
        self._control = control or Comm.new_group(timeout_s=self.timeout_s)
        self._commit = commit or Comm.new_group(timeout_s=self.timeout_s)
        if (self._control.rank, self._control.world_size) != (ranks.rank, ranks.world_size):
            raise CheckpointError(
                f"rank/world size {ranks.rank}/{ranks.world_size} disagree with "
                f"torch.distributed ({self._control.rank}/{self._control.world_size})"
            )
        self._agreement = DecisionAgreement(self._control)

    @property
    def ready(self) -> bool:
        return self._agreement is not None

    @property
    def commit_comm(self) -> Comm | None:
        """The two-phase commit's group (None before :meth:`setup`)."""
        return self._commit

    def decide(
        self,
        step: int,
        loss: float,
        grad_norm: float | None,
        system: SystemSignals,
        busy: bool,
        emergency: bool,
        stop: bool,
    ) -> Agreed:
        """This rank's inputs in, the agreed decision out (see :class:`LocalSignals`)."""
        grad = None if grad_norm is None else float(grad_norm)
        return self.agree(
            LocalSignals(step, loss, grad, system, busy=busy, emergency=emergency, stop=stop)
        )

    def agree(self, local: LocalSignals) -> Agreed:
        """Every rank: same inputs, same decision (logged when some rank was special)."""
        assert self._agreement is not None
        agreed = self._agreement.agree(self.engine.scheduler, local)
        if agreed.busy_ranks or agreed.emergency_ranks or agreed.stop_ranks:
            self.engine.event(
                "agreement",
                step=local.step,
                busy_ranks=list(agreed.busy_ranks),
                emergency_ranks=list(agreed.emergency_ranks),
                stop_ranks=list(agreed.stop_ranks),
            )
        return agreed

    def broadcast(self, value: Json, src: int = 0) -> Json:
        """Rank ``src``'s ``value`` on every rank (identity before :meth:`setup`)."""
        if self._control is None:
            return value
        return self._control.broadcast_json(value if self.engine.ranks.rank == src else None, src)

    def gather(self, value: Json) -> list[Json]:
        """Every rank's ``value``, in rank order (collective, after :meth:`setup`)."""
        assert self._control is not None
        return self._control.all_gather_json(value)

    def broadcast_tensor(self, t: torch.Tensor, src: int = 0) -> None:
        """Rank ``src``'s tensor into ``t`` on every rank (same shape and dtype everywhere)."""
        assert self._control is not None
        self._control.broadcast_tensor(t, src)
