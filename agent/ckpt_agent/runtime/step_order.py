"""Steps only go forward (docs/format.md, "Steps only go forward"): the step index a
:meth:`Checkpointer.step` call passes is checked against the previous call and the resumed
checkpoint. A counter restarted at 0 on the same run, or a call per micro-batch, is refused
(retention orders checkpoints by step and would delete the newer ones); a first step past
the resume point is the off-by-one of passing a framework's count of finished steps, and
is warned about."""

from __future__ import annotations

import logging

from ckpt_agent.errors import StepOrderError
from ckpt_agent.runtime.restore.resume_point import ResumePoint

__all__ = ["StepOrder"]

log = logging.getLogger(__name__)


class StepOrder:
    """The training thread's record of the last step passed to ``step()`` (owned by it)."""

    def __init__(self, run_id: str, storage_url: str) -> None:
        self._run = f"run {run_id!r} on {storage_url}"
        self.last: int | None = None
        self._resume: ResumePoint | None = None
        self._checked_first = False

    def resumed(self, resume: ResumePoint) -> None:
        """``start()`` resumed (or starts fresh at) ``resume``: the next step is ``resume.step``."""
        self._resume = resume
        self.last = resume.step - 1 if resume.step > 0 else None

    def check(self, step: int) -> None:
        """Refuse ``step`` unless it is after the last one (``StepOrderError`` says what to do)."""
        if not self._checked_first:
            self._checked_first = True
            self._warn_first(step)
        last = self.last
        if last is None or step > last:
            return
        resume = self._resume
        resumed = resume is not None and resume.step > 0 and last == resume.step - 1
        where = (
            f"the step of {resume.checkpoint_id or 'the checkpoint'} that start() resumed"
            if resumed and resume is not None
            else "the step passed to the previous step() call"
        )
        raise StepOrderError(
            f"step({step}) is not after step {last}, {where} ({self._run}). Pass the index "
            "of the optimizer step just finished, "
            "once per optimizer step (not per micro-batch); after a resume continue from "
            f"start().step ({last + 1}). A new experiment needs its own run id: set "
            "CKPT_RUN_ID (or AgentConfig.run_id)."
        )

    def _warn_first(self, step: int) -> None:
        expected = self._resume.step if self._resume is not None else 0
        if step > expected:  # lower: refused by check()
            log.warning(
                "step(%d) is the first step() after start(), which continues at step %d: "
                "pass the index of the optimizer step just finished (0 for the first; a "
                "framework's count of finished steps minus one, as "
                "ckpt_agent.integrations does) - a checkpoint of step %d resumes at %d, "
                "so an off-by-one skips a step at every resume",
                step,
                expected,
                step,
                step + 1,
            )
