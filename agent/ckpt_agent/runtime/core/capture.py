"""The live training state the checkpointer saves and restores, as snapshot sections.

:class:`StateCapture` holds the model, optimizer, scheduler, scaler, data
position and training configuration and turns them into the sections of a
snapshot (:meth:`~StateCapture.sections`); :mod:`ckpt_agent.runtime.save.snapshot`
copies those into host buffers, :mod:`ckpt_agent.runtime.shm.target` into shared
memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.serialization import capture_rng
from ckpt_agent.runtime.core.sharded import plan_save, sharded_state

__all__ = ["TRAIN_CONFIG_FILE", "StateCapture", "encode_train_config", "require_state_dicts"]

TRAIN_CONFIG_FILE = "train_config.json"


def encode_train_config(train_config: dict[str, Any] | None) -> bytes | None:
    """``train_config.json`` as stored (TypeError when it is not JSON-serializable)."""
    if train_config is None:
        return None
    try:
        return json.dumps(train_config, sort_keys=True, indent=2, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"train_config must be JSON-serializable: {e}") from None


def require_state_dicts(optimizer: Any, lr_scheduler: Any, grad_scaler: Any) -> None:
    """Refuse, before anything is opened, an object that cannot be saved and restored."""
    for name, obj in (
        ("optimizer", optimizer),
        ("lr_scheduler", lr_scheduler),
        ("grad_scaler", grad_scaler),
    ):
        if obj is not None and not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{name}={type(obj).__name__}(...) has no state_dict()/load_state_dict(), so "
                "it cannot be saved and restored: give it those two methods (torch's "
                f"optimizers and schedulers have them), or pass {name}=None (then it is "
                "not checkpointed and a resume starts it afresh)"
            )


class StateCapture:
    """The objects a checkpoint holds, and how to read them (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        model: torch.nn.Module,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
        dataloader_state: Callable[[], object] | object | None = None,
        train_config: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self.dataloader_state = dataloader_state
        self.train_config = train_config
        self.train_config_bytes = encode_train_config(train_config)

    def sections(self, *, lightweight: bool, step: int, whole: bool = False) -> dict[str, object]:
        """This rank's sections of a snapshot at ``step``.

        Shared (replicated) state is written once, by rank 0 (by every rank with ``whole``:
        a just-in-time save, which any survivor may have to serve); every rank writes its
        own progress, RNG and data position.
        """
        ranks = self.engine.ranks
        shared = whole or ranks.coordinator or not ranks.distributed
        sections: dict[str, object] = {
            "progress": {"step": step, "world_size": ranks.world_size, "rank": ranks.rank},
        }
        if ranks.sharded:  # model + optimizer: this rank's shards (DCP planning)
            state = sharded_state(self.model, self.optimizer, lightweight)
            sections["sharded"] = plan_save(state, coordinator=ranks.coordinator).section()
        elif shared:
            sections["model"] = self.model.state_dict()
        if not lightweight and shared:
            if self.optimizer is not None and not ranks.sharded:
                sections["optimizer"] = self.optimizer.state_dict()
            if self.lr_scheduler is not None:
                sections["lr_scheduler"] = self.lr_scheduler.state_dict()
            if self.grad_scaler is not None:
                sections["grad_scaler"] = self.grad_scaler.state_dict()
        sections["rng"] = capture_rng()
        data = self.data_state()
        if data is not None:
            sections["data"] = data
        if shared:
            sections["scheduler"] = self.engine.scheduler.state_dict()
        return sections

    def data_state(self) -> object:
        """The data position now (None without ``dataloader_state``)."""
        ds = self.dataloader_state
        if ds is None:
            return None
        sd = getattr(ds, "state_dict", None)
        if callable(sd):
            return sd()
        if callable(ds):
            return ds()
        raise TypeError(
            "dataloader_state must have state_dict()/load_state_dict() or be a callable "
            f"returning the data position, not {type(ds).__name__}"
        )

    def files(self, tier: Tier) -> dict[str, bytes]:
        """Extra files of a snapshot: ``train_config.json`` in rank 0's full checkpoints."""
        cfg = self.train_config_bytes
        if tier == Tier.FULL and cfg is not None and self.engine.ranks.coordinator:
            return {TRAIN_CONFIG_FILE: cfg}
        return {}
