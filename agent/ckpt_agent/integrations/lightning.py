"""Exact, resumable checkpointing for Lightning: a ``Callback`` and a resumable sampler.

.. code-block:: python

    from ckpt_agent.integrations.lightning import CheckpointCallback, ResumableSampler

    loader = DataLoader(ds, batch_size=8, sampler=ResumableSampler(ds, seed=0))   # 1
    trainer = L.Trainer(max_steps=1000, callbacks=[CheckpointCallback()])        # 2
    trainer.fit(model, loader)                                                   # 3

:class:`CheckpointCallback` starts the :class:`~ckpt_agent.Checkpointer` in
``on_fit_start`` — the one hook where Lightning has built the optimizer and LR
scheduler (``strategy.setup``) and no loop has started — and restores the model,
optimizer, scheduler, grad scaler and the fit loop's progress
(``fit_loop.load_state_dict``, Lightning's own restore of its loops), so
``global_step``, the epoch and the batch index continue where the checkpoint was
taken. It hands every optimizer step to :meth:`~ckpt_agent.Checkpointer.step` from
``on_train_batch_end`` (where ``ModelCheckpoint`` saves; the loop state is the one
Lightning's own restart logic expects) with the index of the step just finished
(``global_step - 1``), its loss (``training_step``'s) and, when the scheduler uses
one, the gradient norm (``on_before_optimizer_step``).

Lightning restarts an epoch's data from its start unless the loader is stateful:
:class:`ResumableSampler` (a ``DistributedSampler``, so Lightning keeps it under DDP)
draws each epoch's order from ``(seed, epoch)`` alone and, on resume, skips the
batches the restored loop says were trained in that epoch (the loop's count, not the
sampler's: Lightning may fetch ahead). The RNG is put back in ``on_train_start``:
after Lightning has created the data iterator (which draws from the global
generator), before the first batch; from then on the loaders that use a
:class:`ResumableSampler` get their own generator (set in ``on_train_start`` of every
run), so the data iterators Lightning creates later draw nothing from the global RNG.

A ``CheckpointIO`` plugin is deliberately not provided: Lightning hands it a whole
checkpoint dict of arbitrary (picklable) Python objects on ``ModelCheckpoint``'s
schedule, saved synchronously — our format never unpickles, and the point of the
agent is its own adaptive schedule with a low-stall snapshot. ``ModelCheckpoint``
can run alongside for its own files (docs/integrations/lightning.md).

SIGTERM (preemption) goes through the agent's emergency save (``handle_sigterm``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sized
from typing import Any

import torch

from ckpt_agent.integrations._common import IntegrationError, LateState, require
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.runtime.restore.resume_point import ResumePoint

_pl = require("lightning.pytorch", "lightning", "lightning==2.6.6")
_Callback: Any = _pl.Callback

__all__ = ["CheckpointCallback", "IntegrationError", "ResumableSampler"]


class ResumableSampler(torch.utils.data.DistributedSampler):  # type: ignore[type-arg]
    """A shuffling, rank-aware sampler whose order depends on ``(seed, epoch)`` only and
    that can skip the samples an interrupted epoch already trained.

    Ranks and world size come from ``torch.distributed`` when it is initialized at
    iteration time (Lightning's DDP), else 0 and 1; like ``DistributedSampler`` it pads
    (or, with ``drop_last``, trims) the order to a multiple of the world size.
    """

    def __init__(
        self, dataset: Sized, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False
    ) -> None:  # no super().__init__: it needs torch.distributed now, we read it later
        self.dataset = dataset  # type: ignore[assignment]
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self._skip: tuple[int, int] | None = None

    @property
    def num_replicas(self) -> int:
        dist = torch.distributed
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        pass  # Lightning reads it; the process group decides

    @property
    def rank(self) -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @rank.setter
    def rank(self, value: int) -> None:
        pass

    @property
    def num_samples(self) -> int:
        n, w = len(self.dataset), self.num_replicas  # type: ignore[arg-type]
        return n // w if self.drop_last else math.ceil(n / w)

    @num_samples.setter
    def num_samples(self, value: int) -> None:
        pass

    def __len__(self) -> int:
        return self.num_samples

    def skip(self, epoch: int, samples: int) -> None:
        """Skip the first ``samples`` of this rank's order in ``epoch`` (once)."""
        self._skip = (epoch, samples)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self.num_samples * self.num_replicas
        if total > len(order):
            order += (order * math.ceil(total / max(len(order), 1)))[: total - len(order)]
        order = order[:total][self.rank : total : self.num_replicas]
        skip, self._skip = self._skip, None
        if skip is not None and skip[0] == self.epoch:
            order = order[skip[1] :]
        return iter(order)


_SCALARS = (int, float, bool, str, type(None))
_FIELDS: dict[type, tuple[str, ...]] = {}
"""The field names of each progress dataclass (``dataclasses.fields`` is slow)."""


def _progress_state(progress: Any) -> dict[str, Any]:
    """``dataclasses.asdict(progress)`` for Lightning's progress counters (dataclasses of
    ints and of other such dataclasses) without ``asdict``'s deep copy of every int;
    anything else: ``asdict`` itself."""
    names = _FIELDS.get(type(progress))
    if names is None:
        names = _FIELDS[type(progress)] = tuple(f.name for f in dataclasses.fields(progress))
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(progress, name)
        if type(value) in _SCALARS:
            out[name] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[name] = _progress_state(value)
        else:
            return dataclasses.asdict(progress)
    return out


def _loop_state(loop: Any, destination: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``loop.state_dict()`` — the same dict — at a fraction of its cost (it runs at every
    heartbeat, on the training thread): Lightning's ``_Loop.state_dict`` with the progress
    counters read by :func:`_progress_state`. A loop or progress class that overrides
    ``state_dict`` is asked itself."""
    destination[prefix + "state_dict"] = loop.on_save_checkpoint()
    for k, v in loop.__dict__.items():
        kind = _KINDS.get(type(v))
        if kind is None:
            kind = _kind(type(v))
        if kind == _OTHER:
            continue
        key = prefix + k
        if kind == _PROGRESS:
            destination[key] = _progress_state(v)
        elif kind == _LOOP:
            _loop_state(v, destination, key + ".")
        elif kind == _OWN_PROGRESS:
            destination[key] = v.state_dict()
        else:
            v.state_dict(destination, key + ".")
    return destination


_OTHER, _PROGRESS, _OWN_PROGRESS, _LOOP, _OWN_LOOP = range(5)
_KINDS: dict[type, int] = {}
"""What :func:`_loop_state` does with a loop attribute of each type (a loop has dozens of
attributes: two ``isinstance`` each, at every heartbeat, were a third of its cost)."""


def _kind(t: type) -> int:
    base, progress = _pl.loops.loop._Loop, _pl.loops.progress._BaseProgress
    own = getattr(t, "state_dict", None)
    if issubclass(t, progress):
        kind = _PROGRESS if own is progress.state_dict else _OWN_PROGRESS
    elif issubclass(t, base):
        kind = _LOOP if own is base.state_dict else _OWN_LOOP
    else:
        kind = _OTHER
    _KINDS[t] = kind
    return kind


class _FitProgress:
    """The data position: the fit loop's state (``dataloader_state`` slot)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        loop = self.trainer.fit_loop
        if type(loop).state_dict is not _pl.loops.loop._Loop.state_dict:
            state = loop.state_dict()  # a custom fit loop: its own
        else:
            state = _loop_state(loop, {})
        assert isinstance(state, dict)
        return state

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.restored = dict(saved)


class CheckpointCallback(_Callback):  # type: ignore[misc]
    """Checkpoint a Lightning ``fit`` with the agent (see the module doc).

    Args:
        config: the agent config (default: from the environment, as in a pod).
        handle_sigterm: SIGTERM saves the step that just finished and exits 143.
        checkpointer_kwargs: passed to :class:`~ckpt_agent.Checkpointer`.
    """

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        handle_sigterm: bool = True,
        **checkpointer_kwargs: Any,
    ) -> None:
        self.config = config
        self.handle_sigterm = handle_sigterm
        self.kwargs = checkpointer_kwargs
        self.ckpt: Checkpointer | None = None
        self.resume_point: ResumePoint | None = None
        self._rng_pending = False
        self._skip: tuple[int, int] | None = None
        self._epoch_end = False
        self._last_global_step = -1
        self._grad_norm: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.ckpt is not None:
            raise IntegrationError("CheckpointCallback runs one fit(); use a new one per fit()")
        if len(trainer.optimizers) > 1:
            raise IntegrationError("CheckpointCallback supports one optimizer")
        if not pl_module.automatic_optimization:
            raise IntegrationError("CheckpointCallback supports automatic optimization")
        if trainer.fit_loop.restarting or trainer.ckpt_path is not None:
            raise IntegrationError(
                "fit(ckpt_path=...) and CheckpointCallback both restore: pass no ckpt_path"
            )
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1:
            raise IntegrationError("CheckpointCallback supports one LR scheduler")
        scheduler = LateState("LR scheduler")
        scheduler.attach(configs[0].scheduler if configs else None)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        progress = _FitProgress(trainer)
        self.ckpt = Checkpointer(
            self.config,
            model=pl_module,
            optimizer=optimizer,
            lr_scheduler=scheduler if configs else None,
            grad_scaler=scaler,
            dataloader_state=progress,
            handle_sigterm=self.handle_sigterm,
            **self.kwargs,
        )
        resume = self.ckpt.start()
        self.resume_point = resume
        if not resume.resumed:
            return
        self._rng_pending = True  # Lightning draws from the RNG before batch 1: put back later
        saved = progress.restored
        if not saved:
            raise IntegrationError(
                f"checkpoint {resume.checkpoint_id} holds no fit-loop state (not written by "
                "the Lightning CheckpointCallback?)"
            )
        trainer.fit_loop.load_state_dict(saved)
        if trainer.global_step != resume.step:
            raise IntegrationError(
                f"the fit loop restored global step {trainer.global_step}, the agent step "
                f"{resume.step}: the checkpoint's loop state does not match its step"
            )
        epoch_loop = trainer.fit_loop.epoch_loop
        self._skip = (
            trainer.fit_loop.epoch_progress.current.processed,
            epoch_loop.batch_progress.current.ready,
        )
        self._last_global_step = trainer.global_step

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._skip is not None:
            epoch, batches = self._skip
            self._skip = None
            self._epoch_end = batches >= trainer.num_training_batches
            if (
                batches
                and not self._epoch_end
                and not _skip_samplers(trainer.train_dataloader, epoch, batches)
            ):
                raise IntegrationError(
                    f"resuming mid-epoch (epoch {epoch}, batch {batches}) needs the training "
                    "DataLoader to use ckpt_agent.integrations.lightning.ResumableSampler (or a "
                    "stateful loader): Lightning would train the epoch's first batches again"
                )
        # Each new data iterator draws a seed from the global RNG unless its loader has a
        # generator, and Lightning creates them at other moments in a resumed run (one
        # epoch later after a checkpoint of an epoch's last batch): from here on, in every
        # run, they draw from their own generator.
        _own_generators(trainer.train_dataloader)
        if self._rng_pending and self.ckpt is not None:
            self._rng_pending = False
            self.ckpt.restore_rng()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._grad_norm = None
        ckpt = self.ckpt
        if ckpt is not None and ckpt.wants_grad_norm(trainer.global_step):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads:
                self._grad_norm = float(torch.nn.utils.get_total_norm(grads))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ckpt = self.ckpt
        if ckpt is None or trainer.global_step == self._last_global_step:
            return  # gradient accumulation: no optimizer step in this batch
        self._last_global_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            loss = math.nan
        # Lightning counts finished steps: the step just finished has index global_step - 1.
        ckpt.step(trainer.global_step - 1, loss, self._grad_norm)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, SystemExit):
            return  # the emergency save's exit: the checkpointer closed itself
        if self.ckpt is not None:
            if isinstance(exception, Exception):  # with jitSave: the last finished step
                self.ckpt.save_on_failure(exception)
            self.ckpt.close()

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


def _loaders(loaders: Any) -> Iterator[Any]:
    stack = [loaders]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, torch.utils.data.DataLoader):
            yield item


def _own_generators(loaders: Any) -> None:
    for dl in _loaders(loaders):
        sampler = dl.sampler
        if isinstance(sampler, ResumableSampler) and dl.generator is None:
            dl.generator = torch.Generator().manual_seed(sampler.seed)


def _skip_samplers(loaders: Any, epoch: int, batches: int) -> bool:
    """Tell every :class:`ResumableSampler` behind ``loaders`` to skip ``batches``."""
    found = False
    stack = [loaders]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, torch.utils.data.DataLoader):
            sampler = item.sampler
            batch_sampler = item.batch_sampler
            inner = getattr(batch_sampler, "sampler", None)
            for s in (sampler, inner):
                if isinstance(s, ResumableSampler):
                    size = int(item.batch_size or getattr(batch_sampler, "batch_size", 1) or 1)
                    s.skip(epoch, batches * size)
                    found = True
                    break
    return found
