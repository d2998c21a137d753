"""No silent fresh starts: flag running pods whose training code never started the agent.

Runs with each policy's reconcile pass (:mod:`ckpt_operator.planners.agent_presence` decides): a
Warning Event ``AgentMissing`` on the job (once per pod) and the policy condition
``AgentReporting``. For storage the operator cannot read, the pods' termination
messages and a probe of each overdue pod's agent metrics port are the evidence
(:func:`ckpt_operator.planners.agent_presence.unreported_pods`,
:mod:`ckpt_operator.adapters.agentprobe`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from ckpt_agent.policy import StorageType
from ckpt_agent.storage import StorageError
from ckpt_agent.text import clean
from ckpt_operator.adapters.sources import StorageAccessDeniedError
from ckpt_operator.behaviours.deps import Deps, Obj, kind_kw
from ckpt_operator.behaviours.guard import read_refusal, storage_call
from ckpt_operator.behaviours.policies import write_policy_status
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.planners.agent_presence import (
    AGENT_MISSING,
    Presence,
    ProbeResult,
    SilentPod,
    overdue_unreported,
    probe_target,
    restarts,
    running_injected_pods,
    silent_pods,
    unreported_pods,
)
from ckpt_operator.planners.reports import pod_reports
from ckpt_operator.planners.status import (
    ConditionStatus,
    condition_differs,
    get_condition,
    set_condition,
)
from ckpt_operator.planners.validation import parse_policy_spec

__all__ = ["check_agents"]

log = logging.getLogger(__name__)

#: The policy condition this behaviour owns.
CONDITION = "AgentReporting"
#: Longest wait for one pod's agent probe (they run concurrently, on the event loop).
PROBE_TIMEOUT_S = 2.0
#: Probes in flight at once (a fleet's pods are probed only until their agent answers).
PROBES_AT_ONCE = 32
SEEN_SERVING = ProbeResult(Presence.SERVING, "its agent answered an earlier probe")


async def check_agents(deps: Deps, policy: Mapping[str, Any]) -> list[str]:
    """Flag the policy's silent pods; returns their names."""
    meta = meta_of(policy)
    name, namespace = str(meta.name), str(meta.namespace)
    spec, _ = parse_policy_spec(policy.get("spec"))
    if spec is None or spec.agent.report_deadline_seconds <= 0:
        return []
    listed = await deps.api.list_pods(
        node_name=None, label_selector=f"{c.LABEL_INJECTED}=true", namespace=namespace
    )  # the policy's namespace only: a pass costs its pods, not the cluster's
    pods = running_injected_pods(listed, namespace, name)
    if not pods:
        return []
    now = deps.clock()
    deadline = spec.agent.report_deadline_seconds
    try:
        source = await deps.sources(namespace, name, spec)
        if not await storage_call(deps, source.reachable):
            silent: list[SilentPod] = await _blind_verdict(deps, pods, now, deadline)
        else:
            activity: dict[str, list[float]] = {}
            refused: set[str] = set()
            for run_id in sorted({_run_of(p) for p in pods}):
                # Another namespace's run is not read (its pods fail their own owner check).
                refusal = await read_refusal(deps, source, run_id, namespace)
                if refusal is not None:
                    log.info("agent check of %s/%s: %s", namespace, name, clean(refusal))
                    refused.add(run_id)
                    continue
                activity[run_id] = [t for _, t in await storage_call(deps, source.progress, run_id)]
            mine = [p for p in pods if _run_of(p) not in refused]
            # The heartbeat ring is one small read; the checkpoint listing (a walk of the run)
            # only for runs whose heartbeats alone leave a pod silent (heartbeats off).
            for run_id in sorted({s.run_id for s in silent_pods(mine, activity, now, deadline)}):
                records = await storage_call(deps, source.list_checkpoints, run_id)
                activity[run_id] += [r.created_at for r in records]
            silent = silent_pods(mine, activity, now, deadline)
    except StorageAccessDeniedError:
        if spec.storage.type != StorageType.LOCAL:
            return []
        silent = await _blind_verdict(deps, pods, now, deadline)  # a PVC of the namespace
    except (StorageError, ValueError) as e:
        log.info("agent check of %s/%s skipped: %s", namespace, name, clean(e))
        return []
    status: ConditionStatus = "False" if silent else "True"
    reason = "AgentMissing" if silent else "AgentsReporting"
    message = (
        f"pod(s) {', '.join(s.pod for s in silent)}: {AGENT_MISSING}"
        if silent
        else "every running pod's agent has reported in"
    )

    def build(current: Mapping[str, Any]) -> Obj:
        conditions = Body(current).status.get("conditions")
        return {
            "conditions": set_condition(
                conditions, CONDITION, status, reason, message[:2000], now=now
            )
        }

    # the condition first: whoever sees the Event then reads a condition that agrees
    current = get_condition((Body(policy).status.get("conditions")), CONDITION)
    if condition_differs(current, status, reason, message[:2000]):
        await write_policy_status(deps, namespace, name, build)
    for s in silent:
        job = await deps.api.get_job(namespace, s.job, **kind_kw(s.kind)) if s.job else None
        ann = meta_of(job).annotations
        if job is None or ann.get(c.ANN_AGENT_MISSING) == s.pod:
            continue
        deps.events.emit(
            job,
            "Warning",
            "AgentMissing",
            f"pod {s.pod} has run {s.running_s:.0f}s without a heartbeat, checkpoint or "
            f"report of run {s.run_id}{f' ({s.evidence})' if s.evidence else ''}: "
            f"{AGENT_MISSING}",
        )
        await deps.api.patch_job_annotations(
            namespace, s.job, {c.ANN_AGENT_MISSING: s.pod}, **kind_kw(s.kind)
        )
    return [s.pod for s in silent]


def _run_of(pod: Mapping[str, Any]) -> str:
    return str(meta_of(pod).annotations[c.ANN_RUN_ID])


async def _blind_verdict(
    deps: Deps, pods: list[Any], now: float, deadline_s: float
) -> list[SilentPod]:
    """Storage the operator cannot read: what the pods' termination messages say, and
    for the overdue pods without a report, a probe of their agent's metrics port."""
    reports, _ = pod_reports(pods)
    reported = {r.pod for r in reports}
    probes: dict[str, ProbeResult] = {}
    todo: list[tuple[Mapping[str, Any], tuple[str, int]]] = []
    for pod in overdue_unreported(pods, reported, now, deadline_s):
        meta = meta_of(pod)
        if deps.agent_answers.served_before(str(meta.uid), restarts(pod)):
            probes[str(meta.name)] = SEEN_SERVING  # answered before, same processes
        elif (target := probe_target(pod)) is not None:
            todo.append((pod, target))
    gate = asyncio.Semaphore(PROBES_AT_ONCE)

    async def probe(target: tuple[str, int]) -> ProbeResult:
        async with gate:
            return await deps.probe(*target, PROBE_TIMEOUT_S)

    results = await asyncio.gather(*(probe(target) for _, target in todo))
    refused_since: dict[str, float] = {}
    for (pod, _), result in zip(todo, results, strict=True):
        meta = meta_of(pod)
        uid, count = str(meta.uid), restarts(pod)
        probes[str(meta.name)] = result
        if result.presence is Presence.ABSENT:
            # a refusal proves absence only once the same processes refused for a deadline
            refused_since[str(meta.name)] = deps.agent_answers.refused(uid, count, now)
            continue
        # any other answer starts the suspicion over
        serving = result.presence is Presence.SERVING
        deps.agent_answers.answered(uid, count, serving=serving)
        if not serving:
            log.debug("agent probe of pod %s: no verdict (%s)", meta["name"], clean(result.detail))
    return unreported_pods(pods, reported, now, deadline_s, probes, refused_since)
