"""Exact, resumable checkpointing for a stock Hugging Face ``Trainer``: one callback.

.. code-block:: python

    from ckpt_agent.integrations.transformers import CheckpointCallback

    ckpt = CheckpointCallback()                                  # 1
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ckpt])                          # 2
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))   # 3

HF builds its optimizer (``Trainer.create_optimizer``, its default parameter groups)
and LR scheduler as usual. :meth:`CheckpointCallback.resume` starts the
:class:`~ckpt_agent.Checkpointer` before ``train()`` (the checkpoint, and so the
step, must be known before HF reads its ``TrainerState``): the model, optimizer and
grad scaler are restored at once, the LR scheduler's state is held until HF has
built it (``on_train_begin``). When a checkpoint was restored it returns a resume
folder in HF's own format — ``trainer_state.json`` (the restored ``global_step``,
``epoch``, counters) and the restored weights (``model.safetensors``) — so
``Trainer.train`` takes its documented resume path: it skips the batches already
trained (``skip_first_batches``; ``ignore_data_skip`` is honoured) and counts on from
the restored step; no private method is overridden. The folder is removed once HF
has read it.

Every optimizer step reaches the agent's scheduler with its loss (a forward hook
on the model: the mean of the step's micro-batch ``loss`` outputs) and, when the
scheduler uses one, the gradient norm (after clipping, taken in
``on_pre_optimizer_step``), whatever ``logging_steps`` is. The step is handed to
:meth:`~ckpt_agent.Checkpointer.step` in the next step's ``on_step_begin`` (HF's
evaluation and logging of the step have run, the next batch is fetched) with the
index of the step just finished (``global_step - 1``): the RNG captured there is
the one the next step starts from, and a resume restores it at that same point.
The last step goes to the agent in ``on_train_end``, which closes the checkpointer.

SIGTERM (preemption) goes through the agent's emergency save (``handle_sigterm``):
the step that just finished is saved, committed, and the process exits with 143.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ckpt_agent.integrations._common import IntegrationError, LateState, require
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.runtime.restore.resume_point import ResumePoint

_tf = require("transformers", "hf", "transformers==5.23.0")
_TrainerCallback: Any = _tf.TrainerCallback

__all__ = ["CheckpointCallback", "IntegrationError"]

log = logging.getLogger(__name__)

#: The ``TrainerState`` fields a checkpoint carries (small: they are in every heartbeat).
#: ``log_history`` is not among them (it grows with the run).
STATE_FIELDS = (
    "global_step",
    "epoch",
    "num_input_tokens_seen",
    "total_flos",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)


class _TrainerProgress:
    """The data position: HF's ``TrainerState`` counters (``dataloader_state`` slot)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        s = self.trainer.state  # train() replaces it: read it at every save
        return {k: getattr(s, k) for k in STATE_FIELDS}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.restored = dict(saved)


class CheckpointCallback(_TrainerCallback):  # type: ignore[misc]
    """Checkpoint a ``transformers.Trainer`` with the agent (see the module doc).

    Args:
        config: the agent config (default: from the environment, as in a pod).
        handle_sigterm: SIGTERM saves the step that just finished and exits 143.
        checkpointer_kwargs: passed to :class:`~ckpt_agent.Checkpointer` (``storage``,
            ``backpressure``, ``summary_writer``...).
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
        self._trainer: Any = None
        self._scheduler = LateState("LR scheduler")
        self._progress: _TrainerProgress | None = None
        self._rng_pending = False
        self._resume_dir: Path | None = None
        self._hook: Any = None
        self._losses: list[torch.Tensor] = []
        self._grad_norm: float | None = None
        self._pending: tuple[int, torch.Tensor | float, float | None] | None = None
        self._optimizer: Any = None
        self._groups: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ before train()

    def resume(self, trainer: Any) -> str | None:
        """Start the checkpointer, restore the newest valid checkpoint; the folder to pass
        as ``trainer.train(resume_from_checkpoint=...)`` (None: a fresh start)."""
        if self.ckpt is not None:
            raise IntegrationError("CheckpointCallback.resume() was already called")
        if self not in trainer.callback_handler.callbacks:
            raise IntegrationError(
                "pass the callback to the Trainer (Trainer(..., callbacks=[ckpt])) before "
                "ckpt.resume(trainer)"
            )
        for what in ("is_deepspeed_enabled", "is_fsdp_enabled", "is_fsdp_xla_enabled"):
            if getattr(trainer, what, False):
                raise IntegrationError(
                    f"CheckpointCallback does not support {what.removeprefix('is_')[:-8]} "
                    "(HF builds the optimizer after sharding the model); see "
                    "docs/integrations/transformers.md"
                )
        if trainer.model_init is not None:
            raise IntegrationError(
                "CheckpointCallback needs the model itself, not model_init (train() would "
                "build another model after the restore)"
            )
        self._trainer = trainer
        # HF's own optimizer (its default no-decay groups); train() keeps this one.
        self._optimizer = trainer.create_optimizer()
        self._scheduler = LateState("LR scheduler", lambda: trainer.lr_scheduler)
        self._progress = _TrainerProgress(trainer)
        scaler = getattr(trainer.accelerator, "scaler", None)
        self.ckpt = Checkpointer(
            self.config,
            model=trainer.model,
            optimizer=self._optimizer,
            lr_scheduler=self._scheduler,
            grad_scaler=scaler,
            dataloader_state=self._progress,
            handle_sigterm=self.handle_sigterm,
            **self.kwargs,
        )
        resume = self.ckpt.start()
        self.resume_point = resume
        self._hook = trainer.model.register_forward_hook(self._on_forward)
        if not resume.resumed:
            return None
        # start() restored the RNG now; HF's next steps (data loaders, its own seeding)
        # draw from it before the first step: the agent puts it back for that step.
        self._rng_pending = True
        # HF's scheduler, built in train(), sets the groups' lr to its step 0: the restored
        # group settings are put back before the scheduler's state (HF's own load order).
        self._groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups
        ]
        saved = self._progress.restored or {}
        if int(saved.get("global_step", -1)) != resume.step:
            raise IntegrationError(
                f"checkpoint {resume.checkpoint_id} holds no TrainerState for step "
                f"{resume.step} (not written by CheckpointCallback?)"
            )
        self._resume_dir = self._write_resume_dir(trainer, saved)
        return str(self._resume_dir)

    def _write_resume_dir(self, trainer: Any, saved: dict[str, Any]) -> Path:
        """HF's checkpoint folder for ``train(resume_from_checkpoint=)``: state + weights."""
        args = trainer.args
        rank = getattr(args, "process_index", 0)
        folder = Path(tempfile.mkdtemp(prefix=f"ckpt-hf-resume-{saved['global_step']}-r{rank}-"))
        state = _tf.TrainerState()
        for k, v in saved.items():
            setattr(state, k, v)
        state.train_batch_size = args.train_batch_size
        state.compute_steps(args, 0 if args.max_steps is None else args.max_steps)
        state.log_history = []
        folder.joinpath(_tf.trainer.TRAINER_STATE_NAME).write_text(
            json.dumps(asdict(state), indent=2, sort_keys=True) + "\n"
        )
        # Every rank writes its own folder (save_pretrained writes on rank 0 only); shared
        # (tied) tensors once: HF loads it with strict=False and they share storage.
        from safetensors.torch import save_model

        save_model(trainer.model, str(folder / "model.safetensors"))
        return folder

    # ------------------------------------------------------------------ hooks

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None and isinstance(output, tuple | list) and output:
            loss = output[0] if isinstance(output[0], torch.Tensor) else None
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            self._losses.append(loss.detach())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ckpt, resume = self.ckpt, self.resume_point
        if ckpt is None or resume is None:
            raise IntegrationError(
                "CheckpointCallback was not started: call "
                "trainer.train(resume_from_checkpoint=ckpt.resume(trainer)) — without it "
                "a restarted job would train from step 0 on top of restored weights"
            )
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None
        if state.global_step != resume.step:
            raise IntegrationError(
                f"the agent restored step {resume.step} but the Trainer starts at global step "
                f"{state.global_step}: pass resume_from_checkpoint=ckpt.resume(trainer) to "
                "trainer.train() (and nothing else)"
            )
        optimizer = kw.get("optimizer")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if inner is not self._optimizer:
            raise IntegrationError(
                "the Trainer built another optimizer than the one restored; "
                "CheckpointCallback supports the optimizer HF creates or the one passed "
                "in Trainer(optimizers=...)"
            )
        if self._groups is not None:
            groups: list[dict[str, Any]] = self._optimizer.param_groups  # type: ignore[union-attr]
            for group, saved in zip(groups, self._groups, strict=True):
                group.update(saved)
            self._groups = None
        self._scheduler.attach(kw.get("lr_scheduler"))
        self._losses.clear()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._flush()
        if self._rng_pending and self.ckpt is not None:  # the first step after a resume
            self._rng_pending = False
            self.ckpt.restore_rng()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ckpt = self.ckpt
        self._grad_norm = None
        if ckpt is not None and ckpt.wants_grad_norm(state.global_step):
            model = kw.get("model")
            grads = [p.grad for p in model.parameters() if p.grad is not None] if model else []
            if grads:
                self._grad_norm = float(torch.nn.utils.get_total_norm(grads))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        losses, self._losses = self._losses, []
        loss: torch.Tensor | float = math.nan
        if len(losses) == 1:  # no accumulation: the mean of one is that one (no two ops a step)
            loss = losses[0]
        elif losses:
            loss = torch.stack(losses).mean()
        # HF counts finished steps: the step just finished has index global_step - 1.
        self._pending = (state.global_step - 1, loss, self._grad_norm)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._flush()
        self.close()

    def save_on_failure(self, error: BaseException | None = None) -> str | None:
        """A just-in-time save after ``trainer.train()`` raised (``spec.agent.jitSave``; see
        :meth:`Checkpointer.save_on_failure <ckpt_agent.Checkpointer.save_on_failure>`).
        ``transformers`` has no callback for a failure, so the script calls it::

            try:
                trainer.train(resume_from_checkpoint=callback.resume(trainer))
            except Exception as err:
                callback.save_on_failure(err)
                raise

        The agent is closed afterwards (the run is over; a failure to close is logged, the
        original error is what counts).
        """
        if self.ckpt is None:
            return None
        saved = self.ckpt.save_on_failure(error)
        try:
            self.close()
        except Exception:
            log.exception("closing the agent after the failure failed")
        return saved

    def close(self) -> None:
        """Wait for the running persist and stop the agent (``on_train_end`` calls it)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.ckpt is not None:
            self.ckpt.close()

    def _flush(self) -> None:
        if self._pending is None or self.ckpt is None:
            return
        step, loss, grad_norm = self._pending
        self._pending = None
        self.ckpt.step(step, loss, grad_norm)
