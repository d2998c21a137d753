"""kopf handlers for Kueue Workloads (only with ``--kueue``; docs/kueue.md).

:func:`register_kueue` adds, on the operator's registry:

* a watch-event handler on ``workloads.kueue.x-k8s.io`` → :func:`reconcile_workload`
  (the priority boost, the save on eviction, the steps lost on re-admission);
* a refresh loop (startup/cleanup handlers): every :data:`REFRESH_S` each known
  Workload is looked at again, since at-risk work grows without any event; a Workload
  whose boost was written less than ``minUpdateSeconds`` ago is skipped without reading
  storage (:func:`~ckpt_operator.planners.preemption.boost_due`).

Without ``--kueue`` nothing here is registered: a cluster without Kueue sees no watch on
a resource it does not have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from ckpt_agent.text import clean
from ckpt_operator.adapters.kube import NotFoundError
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.behaviours.preemption import PreemptionState, reconcile_workload
from ckpt_operator.planners.workload import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    WORKLOADS,
)

__all__ = ["REFRESH_S", "KueueHandlers", "register_kueue"]

log = logging.getLogger(__name__)

#: How often every known Workload is looked at again (seconds).
REFRESH_S = 10.0


class KueueHandlers:
    """The Workload handlers and their refresh loop, over the operator's :class:`Deps`
    (``deps_of(memo)``: the handlers' own accessor, so this module never imports them)."""

    def __init__(self, deps_of: Callable[[Any], Deps], refresh_s: float = REFRESH_S) -> None:
        self.deps_of = deps_of
        self.refresh_s = refresh_s
        self.state = PreemptionState()
        self._task: asyncio.Task[None] | None = None

    async def look(self, deps: Deps, workload: Mapping[str, Any]) -> None:
        """One Workload, errors logged (one Workload's trouble never stops the others)."""
        try:
            await reconcile_workload(deps, self.state, workload)
        except NotFoundError:
            log.debug("Workload or its job went meanwhile")
        except Exception as e:
            meta = workload.get("metadata") or {}
            log.warning(
                "Workload %s/%s: %s",
                clean(str(meta.get("namespace"))),
                clean(str(meta.get("name"))),
                clean(e),
                exc_info=log.isEnabledFor(logging.DEBUG),
            )

    async def on_event(self, type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        workload = dict(body)
        if type == "DELETED":
            self.state.forget(workload)
            return
        self.state.upsert(workload)
        await self.look(self.deps_of(memo), workload)

    async def refresh_all(self, deps: Deps) -> None:
        """One refresh pass over every known Workload."""
        for workload in self.state.all():
            await self.look(deps, workload)

    async def _loop(self, deps: Deps) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh_all(deps)

    async def on_startup(self, memo: kopf.Memo, **_: Any) -> None:
        self._task = asyncio.create_task(self._loop(self.deps_of(memo)), name="kueue-refresh")

    async def on_cleanup(self, **_: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def register_kueue(
    registry: kopf.OperatorRegistry, deps_of: Callable[[Any], Deps]
) -> KueueHandlers:
    """Register the Workload handlers on ``registry``; returns them (tests drive them)."""
    handlers = KueueHandlers(deps_of)
    kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, registry=registry, id="kueue-workload")(
        handlers.on_event
    )
    kopf.on.startup(registry=registry, id="kueue-refresh")(handlers.on_startup)
    kopf.on.cleanup(registry=registry, id="kueue-refresh-stop")(handlers.on_cleanup)
    return handlers
