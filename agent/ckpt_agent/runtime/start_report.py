"""What :meth:`Checkpointer.start` tells a person: one line saying what the resume restored
(or that the run starts fresh) and where the checkpoints go; a warning when the default run
id continued checkpoints that may be another experiment's."""

from __future__ import annotations

import logging
import sys

from ckpt_agent.format.layout import parse_checkpoint_id
from ckpt_agent.policy.agent_config import DEFAULT_RUN_ID
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.restore.resume_point import ResumePoint
from ckpt_agent.text import LOG_LIMIT, clean

__all__ = ["note", "report_start"]

log = logging.getLogger(__name__)


def note(message: str) -> None:
    """An INFO line for people; on stderr too while logging is not configured (a local
    run would otherwise never see where its checkpoints went). The message quotes a run
    id, a storage URL and a checkpoint id: it goes out through :func:`clean`."""
    shown = clean(message, LOG_LIMIT)
    log.info("%s", shown)
    if not logging.getLogger().hasHandlers():
        print(f"ckpt_agent: {shown}", file=sys.stderr)


def report_start(e: Engine, resume: ResumePoint, *, from_shm: bool, seconds: float) -> None:
    """One line (rank 0): what the resume restored, or that the run starts fresh; and
    where the checkpoints go."""
    if not e.ranks.coordinator:
        return
    where = f"checkpoints of run {e.run_id!r} go to {e.config.storage_url}"
    if resume.checkpoint_id is None:
        note(f"no checkpoint to resume: fresh start; {where} (CKPT_STORAGE_URL, CKPT_RUN_ID)")
        return
    try:
        tier, step = parse_checkpoint_id(resume.checkpoint_id)
        what = f"step {step}, tier {tier.value}"
    except ValueError:
        what = "step ?"
    source = "shared memory (in-place restart)" if from_shm else e.storage.url
    exact = "" if resume.exact else ", not bit-exact"
    note(
        f"resumed {resume.checkpoint_id} ({what}, from {source}, {resume.action}{exact}) "
        f"in {seconds:.2f} s: training continues at step {resume.step}; {where}"
    )
    if e.run_id == DEFAULT_RUN_ID and not e.config.resume_from:
        log.warning(
            "resumed run %r, the default run id: if this is a new experiment, it just "
            "continued another one's checkpoints; give it its own run id (CKPT_RUN_ID)",
            e.run_id,
        )
