"""Storage access from the behaviours: bounded in time, and only to runs of the namespace.

:func:`storage_call` runs a blocking :class:`~ckpt_operator.adapters.sources.CheckpointSource`
call in a thread and stops waiting for it after ``config.storage_timeout_s``
(:class:`~ckpt_operator.adapters.sources.StorageTimeoutError`): a stuck storage never
holds a handler forever. (Python cannot kill the thread; it ends when the
backend's own timeouts fire — S3 connect/read timeouts are capped at the same
value — and its result is dropped.)

:func:`run_access` reads a run's owner (:mod:`ckpt_agent.format.owner`) before
anything else touches the run; the operator never writes one. A run owned by
another namespace is refused; a run with no owner record and checkpoints (a legacy
run: :meth:`RunAccess.unclaimed`) is left alone until an administrator claims it
(``ckpt claim``); a run with neither is new (its writer claims it at start).
:func:`read_refusal` is the owner check alone, for paths that only look (the agent
check).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, TypeVar

from ckpt_agent.errors import CheckpointFormatError
from ckpt_operator.adapters.sources import CheckpointSource, StorageTimeoutError
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.planners.tenancy import owner_refusal, unclaimed_refusal

__all__ = ["RunAccess", "read_refusal", "run_access", "storage_call"]

T = TypeVar("T")


async def storage_call(
    deps: Deps,
    fn: Callable[..., T],
    /,
    *args: Any,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> T:
    """``fn(*args, **kwargs)`` in a thread, waiting at most ``timeout_s`` (default
    ``config.storage_timeout_s``)."""
    timeout = deps.config.storage_timeout_s if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(functools.partial(fn, *args, **kwargs)), timeout
        )
    except TimeoutError:
        name = getattr(fn, "__name__", "storage call")
        raise StorageTimeoutError(f"{name} did not return within {timeout:.0f}s") from None


@dataclass(frozen=True)
class RunAccess:
    """What a namespace may do with a run, from its owner record (read, never written)."""

    run_id: str
    namespace: str
    refusal: str | None = None
    """Why the namespace may not touch the run at all (another namespace owns it, or its
    owner record is unreadable); None: it may look."""
    claimed: bool = False
    """An owner record names the namespace (False: the run has none)."""

    def unclaimed(self, checkpoints: Sized) -> str | None:
        """Why a run that may be looked at must still be left alone (None: the namespace
        owns it, or it is new: no record and no checkpoints, its writer claims it)."""
        if self.refusal is not None or self.claimed:
            return None
        return unclaimed_refusal(self.run_id, self.namespace, len(checkpoints))


async def run_access(
    deps: Deps, source: CheckpointSource, run_id: str, namespace: str
) -> RunAccess:
    """Read run ``run_id``'s owner record for ``namespace`` (claims nothing)."""
    try:
        owner = await storage_call(deps, source.run_owner, run_id)
    except CheckpointFormatError as e:
        return RunAccess(run_id, namespace, f"run {run_id}: unreadable owner record ({e})")
    if owner is None:
        return RunAccess(run_id, namespace)
    refusal = owner_refusal(run_id, owner.namespace, namespace)
    return RunAccess(run_id, namespace, refusal, claimed=refusal is None)


async def read_refusal(
    deps: Deps, source: CheckpointSource, run_id: str, namespace: str
) -> str | None:
    """Why ``namespace`` may not read run ``run_id`` (None: it may), claiming nothing.

    A run without an owner record is readable (only its activity is read: the agent
    check); an unreadable record refuses.
    """
    return (await run_access(deps, source, run_id, namespace)).refusal
