"""Storage access from the behaviours: bounded in time, and only to runs of the namespace.

:func:`storage_call` runs a blocking :class:`~ckpt_operator.adapters.sources.CheckpointSource`
call in a thread and stops waiting for it after ``config.storage_timeout_s``
(:class:`~ckpt_operator.adapters.sources.StorageTimeoutError`): a stuck storage never
holds a handler forever. (Python cannot kill the thread; it ends when the
backend's own timeouts fire — S3 connect/read timeouts are capped at the same
value — and its result is dropped.)

:func:`run_refusal` claims or reads a run's owner (:mod:`ckpt_agent.format.owner`)
before anything else touches the run; :func:`read_refusal` only reads it (for
paths that only look, e.g. the agent check).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.owner import RunOwner
from ckpt_operator.adapters.sources import CheckpointSource, StorageTimeoutError
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.model.jobs import JobFacts
from ckpt_operator.planners.tenancy import owner_refusal

__all__ = ["read_refusal", "run_refusal", "storage_call"]

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


async def run_refusal(
    deps: Deps, source: CheckpointSource, run_id: str, job: JobFacts
) -> str | None:
    """Why ``job``'s namespace may not use run ``run_id`` (None: it may).

    A run without an owner record (new, or written before owners existed) is
    claimed for ``job``'s namespace on first sight.
    """
    claim = RunOwner(job.namespace, job.name, job.uid, "operator", deps.clock())
    owner = await storage_call(deps, source.claim_run, run_id, claim)
    return owner_refusal(run_id, owner.namespace, job.namespace)


async def read_refusal(
    deps: Deps, source: CheckpointSource, run_id: str, namespace: str
) -> str | None:
    """Why ``namespace`` may not read run ``run_id`` (None: it may), claiming nothing.

    A run without an owner record is readable (its pods' agent claims it); an
    unreadable record refuses (as :func:`run_refusal` would fail).
    """
    try:
        owner = await storage_call(deps, source.run_owner, run_id)
    except CheckpointFormatError as e:
        return f"run {run_id}: unreadable owner record ({e})"
    return None if owner is None else owner_refusal(run_id, owner.namespace, namespace)
