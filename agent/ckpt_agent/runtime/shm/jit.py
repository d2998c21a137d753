"""Just-in-time saves: the survivors of a rank that died mid-step save the last step.

With ``spec.agent.jitSave`` (flash snapshots, replicated state), :class:`JitSave` does two
things:

* **every step** (inside ``Checkpointer.step``, before the step's agreement): captures the
  heartbeat of the step (RNG states, data position:
  :class:`~ckpt_agent.runtime.save.heartbeat.HeartbeatCapturer`) and writes it into the
  rank's step heartbeat in shared memory (:mod:`ckpt_agent.flash.step_heartbeat`: a memory
  copy, no system call), where it survives the process; an optimizer step post-hook counts
  the optimizer steps since.
* **on a failure** (:meth:`save`, from ``Checkpointer.save_on_failure``, the ``with``
  block's exit with an exception, or a framework callback): when the optimizer has not
  stepped since the last ``step()`` — the failure came out of the next step's forward or
  backward, e.g. its all-reduce, so the model and optimizer are still exactly that step's
  — it writes a snapshot of step *s* with the whole replicated state and the RNG and data
  position captured at *s* (not the live ones, which the failed step moved on), without
  any collective, under the token every survivor derives alone
  (:func:`~ckpt_agent.runtime.shm.persister.jit_token`).

The restart (:mod:`ckpt_agent.runtime.shm.in_place`) restores it on the survivors and, on
a rank that died, with that rank's own step heartbeat of step *s*: at most the failed step
is lost. When the optimizer had stepped (the failure came after ``optimizer.step()``),
nothing is saved: the live state is not the recorded step's, and the restart takes the
newest common snapshot or storage as without JIT. Sharded (FSDP) state is out: a dead
rank's shard exists only in its own memory.
"""

from __future__ import annotations

import logging
from typing import Any

from ckpt_agent.decide.decision import Decision
from ckpt_agent.flash.step_heartbeat import StepHeartbeatSlot, encode_payload
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.inline import heartbeat_state
from ckpt_agent.runtime.save.heartbeat import HeartbeatCapture, HeartbeatCapturer, RngPacker
from ckpt_agent.runtime.shm.persister import ShmPersister
from ckpt_agent.text import clean

__all__ = ["JitSave", "jit_unsupported"]

log = logging.getLogger(__name__)


def _hookable(optimizer: Any) -> Any:
    """The torch optimizer behind a framework's wrapper (accelerate's, Lightning's), or None."""
    for obj in (optimizer, getattr(optimizer, "optimizer", None)):
        if callable(getattr(obj, "register_step_post_hook", None)):
            return obj
    return None


def jit_unsupported(engine: Engine, capture: StateCapture, persister: object) -> str:
    """Why just-in-time saves cannot be on here ("" when they can)."""
    if not isinstance(persister, ShmPersister):
        return "it needs flash snapshots (spec.agent.sidecar, or CKPT_SHM_DIR for a local run)"
    if engine.ranks.sharded:
        return "sharded (FSDP) state: a dead rank's shard is nowhere else"
    if _hookable(capture.optimizer) is None:
        return (
            "no torch optimizer to watch (its step post-hook tells a failure before "
            "optimizer.step() from one after it)"
        )
    return ""


class JitSave:
    """This rank's step heartbeat and just-in-time save (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        capture: StateCapture,
        persister: ShmPersister,
        capturer: HeartbeatCapturer,
    ) -> None:
        self.engine = engine
        self.capture = capture
        self.persister = persister
        self.capturer = capturer
        self.slot = StepHeartbeatSlot(persister.flash.reader.dir)
        self.last: HeartbeatCapture | None = None
        """The newest step's capture (None: no step yet in this process)."""
        self.stepped = 0
        """Optimizer steps since :attr:`last` was captured."""
        self._broken = ""
        self._pack = RngPacker()
        self._hook = _hookable(capture.optimizer).register_step_post_hook(self._on_step)

    def _on_step(self, *_: object) -> None:
        self.stepped += 1

    def record(self, step: int) -> HeartbeatCapture:
        """Capture ``step``'s heartbeat and write it to shared memory (training thread)."""
        cap = self.capturer(step)
        self.last, self.stepped = cap, 0
        if self._broken:
            return cap
        try:
            payload = encode_payload(cap.time, self._pack(cap), cap.data)
            self.slot.write(step, self.persister.epoch, payload)
        except ValueError as err:  # too big a data position: JIT off for this process
            self._broken = str(err)
            log.warning("just-in-time saves are off: %s", clean(err))
            self.engine.event("jit_save", outcome="off", reason=str(err))
        return cap

    def save(self, error: BaseException | None) -> str | None:
        """Save the last recorded step now, if the live state is still that step's; the
        snapshot's checkpoint id, or None (why is logged and in the decision log)."""
        cap, why = self.last, ""
        if cap is None:
            why = "no step finished in this process"
        elif self._broken:
            why = self._broken
        elif self.stepped:
            why = (
                f"the optimizer stepped after step {cap.step} was recorded: the live state "
                "is not that step's"
            )
        elif self.persister.newest_step == cap.step:
            why = f"this rank's memory holds step {cap.step} already"
        failure = "" if error is None else f"{type(error).__name__}: {error}"
        if cap is None or why:
            self._report("skipped", cap, why, failure)
            return None
        decision = Decision(
            step=cap.step,
            save=True,
            tier=Tier.PULSE,
            emergency=True,
            reason=f"just-in-time save: {failure or 'requested'}",
        )
        sections = self.capture.sections(lightweight=False, step=cap.step, whole=True)
        data, rng = heartbeat_state(cap.heartbeat())
        sections["rng"] = rng
        if data is None:
            sections.pop("data", None)
        else:
            sections["data"] = data
        desc = self.persister.save_jit(decision, sections)
        if desc is None:
            self._report("failed", cap, "no free shared-memory slot", failure)
            return None
        self._report("saved", cap, f"snapshot {desc.seq}, {desc.stall_s:.3f} s", failure)
        return desc.checkpoint_id

    def _report(self, outcome: str, cap: HeartbeatCapture | None, why: str, failure: str) -> None:
        step = None if cap is None else cap.step
        self.engine.event("jit_save", outcome=outcome, step=step, reason=why, failure=failure)
        self.engine.decisions.flush()  # the process is on its way out
        log.warning("just-in-time save of step %s: %s (%s)", step, outcome, clean(why))

    def close(self) -> None:
        self._hook.remove()
        self.slot.close()
