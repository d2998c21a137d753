"""kopf handlers: thin glue from kopf's callbacks to :mod:`ckpt_operator.behaviours`.

:func:`register` wires them onto a registry (``main.py`` uses a fresh one;
tests do the same). The shared state travels in kopf's ``memo`` as a
:class:`Runtime` under the key ``"ckpt"``.

==========================  ==================================================================
CheckpointPolicy            create/update/resume → validate, ``Ready`` + ``observedGeneration``,
                            publish the agent ConfigMap; every watch event feeds the retention
                            loop (each policy at its own interval); validating webhook
                            ``validate-policy`` (field-level messages)
PyTorchJob (webhook)        ``validate-job``: rejects bad ``ckpt.dev`` annotations (run id,
                            resume point), naming the annotation
PyTorchJob (opted in)       every watch event → bookkeeping (run id, missing policy) and, when
                            Failed, the recovery scheduler (plan → Events → recreate)
PyTorchJob (mutating)       ``label-job``: CREATE of an opted-in job → ``ckpt.dev/inject`` on its
                            pod templates, so every pod of it carries the label
TrainJob (webhooks)         ``label-trainjob``: CREATE of an opted-in TrainJob → the operator's
                            ``spec.runtimePatches`` entry labelling its trainer pods;
                            ``validate-trainjob`` as ``validate-job``
TrainJob (opted in)         as a PyTorchJob, plus each JobSet restart attempt planned
                            (:mod:`ckpt_operator.behaviours.attempts`)
JobSet (events)             the JobSet cache (its restart attempt) → the TrainJob's planning
Pod (mutating webhook)      ``inject-pods``: CREATE of labelled pods → JSON Patch (from the watch
                            caches, within ``--webhook-budget``; fails closed)
Pod (training, events)      pod index for recovery; reports opted-in pods running uninjected;
                            once a replicating job's ranks are all on nodes, its replica
                            peer map (:mod:`ckpt_operator.behaviours.replica_maps`)
Pod (injected, events)      DisruptionTarget / deletion → ``ckpt.dev/save-now``
Node (events)               cordon / going-away taint / NotReady / pressure → a node warning in
                            ``ckpt.dev/save-now`` on its pods; calm again → its clearing;
                            its zone and rack labels (the replica peer choice)
Workload (Kueue, events)    only with ``--kueue`` (:mod:`ckpt_operator.app.kueue`): priority
                            boost from the at-risk work, save-now on eviction
probe                       liveness details (loops, tracked policies, active recoveries)
==========================  ==================================================================
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from ckpt_operator.adapters.caches import ObjectCache, PodIndex
from ckpt_operator.adapters.kube import NotFoundError
from ckpt_operator.app.admission_answer import answer_with
from ckpt_operator.app.kueue import register_kueue
from ckpt_operator.app.loops import MemoryReturn, RecoveryScheduler, RetentionLoop
from ckpt_operator.behaviours.admission import (
    inject_pod,
    label_job_ops,
    report_unprotected,
    trainjob_label_targets,
    validate_job,
    validate_policy,
)
from ckpt_operator.behaviours.agentcheck import check_agents
from ckpt_operator.behaviours.attempts import attempt_due, observe_trainjob, recover_trainjob
from ckpt_operator.behaviours.deps import Deps, cached_job
from ckpt_operator.behaviours.disruption import signal_node, signal_pod
from ckpt_operator.behaviours.policies import reconcile_policy
from ckpt_operator.behaviours.recovery import observe_job, recover_job, report_fenced_pod
from ckpt_operator.behaviours.replica_maps import publish_peer_map
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.kinds.trainjob import TRAINJOB, add_inject_patch, jobset_trainjob, pod_ended_at
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.planners.replica_topology import ZONE_LABEL

__all__ = ["EVENT_ONLY_KINDS", "DiffBaseForChanges", "Runtime", "make_runtime", "register"]

POLICY = ("ckpt.dev", "v1alpha1", "checkpointpolicies")
PYTORCHJOB = (c.PYTORCHJOB_GROUP, c.PYTORCHJOB_VERSION, c.PYTORCHJOB_PLURAL)
TRAINJOBS = (c.TRAINJOB_GROUP, c.TRAINJOB_VERSION, c.TRAINJOB_PLURAL)
JOBSETS = (c.JOBSET_GROUP, c.JOBSET_VERSION, c.JOBSET_PLURAL)
MEMO_KEY = "ckpt"

log = logging.getLogger(__name__)

#: Kinds that :func:`register` gives watch-event handlers only (no create/update/resume/
#: field/delete handlers): kopf never reads their diff base.
EVENT_ONLY_KINDS = frozenset(
    {"Pod", "Node", c.PYTORCHJOB_KIND, c.TRAINJOB_KIND, "JobSet", "Workload"}
)


class DiffBaseForChanges(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base (the object's "essence", stored in an annotation), for the kinds
    that have change-detection handlers only.

    kopf builds the essence (a deep copy of the body, then cleaned and diffed) on every
    watch event of every watched object, although only change-detection handlers read it;
    for the pods, jobs and nodes (:data:`EVENT_ONLY_KINDS`) it was the operator's largest
    CPU cost at fleet scale (issue #19). For them there is no diff base (``None``: kopf's
    "never handled", which only change-detection handlers would look at)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        if body.get("kind") in EVENT_ONLY_KINDS:
            return None
        return super().build(body=body, extra_fields=extra_fields)

    def fetch(self, *, body: kopf.Body) -> Any:
        if body.get("kind") in EVENT_ONLY_KINDS:
            return None
        return super().fetch(body=body)


@dataclass
class Runtime:
    """The operator's shared state (in kopf's memo)."""

    deps: Deps
    recovery: RecoveryScheduler
    retention: RetentionLoop
    trainjob_recovery: RecoveryScheduler
    """TrainJobs' recoveries and JobSet restart attempts."""
    memory: MemoryReturn = field(default_factory=MemoryReturn)
    """Deleted jobs' and pods' memory back to the OS (their ``DELETED`` events)."""


def make_runtime(deps: Deps) -> Runtime:
    async def recover(job: dict[str, Any]) -> float | None:
        return await recover_job(deps, job)

    async def reconcile(policy: dict[str, Any]) -> object:
        status = await reconcile_retention(deps, policy)
        await check_agents(deps, policy)
        return status

    async def recover_train(trainjob: dict[str, Any]) -> float | None:
        return await recover_trainjob(deps, trainjob)

    return Runtime(
        deps=deps,
        # the job as the watch (or the operator's own last write) left it; a GET on a miss
        recovery=RecoveryScheduler(
            functools.partial(cached_job, deps),
            recover,
            error_backoff_s=deps.config.recovery.error_backoff_s,
        ),
        retention=RetentionLoop.from_config(reconcile, deps.config, clock=deps.clock),
        trainjob_recovery=RecoveryScheduler(
            functools.partial(cached_job, deps, kind=TRAINJOB),
            recover_train,
            error_backoff_s=deps.config.recovery.error_backoff_s,
        ),
    )


def _rt(memo: Any) -> Runtime:
    return cast(Runtime, memo[MEMO_KEY])


def _raw(body: Any) -> dict[str, Any]:
    return dict(body)


# --------------------------------------------------------------------------- lifecycle


async def on_startup(memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    if rt.deps.config.retention.enabled:
        rt.retention.start()


async def on_cleanup(memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    rt.memory.stop()
    await rt.retention.stop()
    await rt.recovery.stop()
    await rt.trainjob_recovery.stop()


def on_probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    rt = _rt(memo)
    return {
        "policies": len(rt.retention.policies),
        "retentionPasses": rt.retention.passes,
        "retentionLastError": rt.retention.last_error,
        "activeRecoveries": len(rt.recovery.active) + len(rt.trainjob_recovery.active),
    }


# --------------------------------------------------------------------------- policies


async def on_policy(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    # writes Ready itself (guarded read-modify-write, see policies.write_policy_status):
    # kopf's status patch would replace the conditions the retention loop writes
    await reconcile_policy(rt.deps, _raw(body))
    rt.retention.upsert(_raw(body))


async def on_policy_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    meta = meta_of(body)
    if type == "DELETED":
        rt.retention.remove(str(meta.namespace), str(meta.name))
        rt.deps.policies.remove(str(meta.namespace), str(meta.name))
    else:
        rt.retention.upsert(_raw(body))
        rt.deps.policies.upsert(_raw(body))


def on_validate_policy(spec: kopf.Spec, patch: kopf.Patch | None = None, **_: Any) -> None:
    if patch is not None:  # a validation: no patch to build (see admission_answer)
        answer_with(patch, [])
    errors = validate_policy(dict(spec))
    if errors:
        raise kopf.AdmissionError("invalid CheckpointPolicy: " + "; ".join(errors), code=422)


def on_validate_job(
    body: kopf.Body, old: kopf.Body | None = None, patch: kopf.Patch | None = None, **_: Any
) -> None:
    if patch is not None:  # a validation: no patch to build (see admission_answer)
        answer_with(patch, [])
    errors = validate_job(_raw(body), _raw(old) if old is not None else None)
    if errors:
        kind = str(body.get("kind") or c.PYTORCHJOB_KIND)
        raise kopf.AdmissionError(f"invalid {kind}: " + "; ".join(errors), code=422)


# --------------------------------------------------------------------------- pods: injection


async def on_mutate_pod(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    warnings: list[str],
    dryrun: bool = False,
    **_: Any,
) -> None:
    pod = _raw(body)
    namespace = str(meta_of(pod).namespace or "")
    deps = _rt(memo).deps
    budget = deps.config.webhook.budget_s
    try:
        outcome = await asyncio.wait_for(inject_pod(deps, pod, namespace, dryrun=dryrun), budget)
    except Exception as e:
        # Fail closed: this pod belongs to an opted-in job (ckpt.dev/inject label); admitted
        # unchanged it would train without checkpoints and resume from step 0. Refused, the
        # training-operator retries its creation.
        log.exception("injection into a pod in %s failed; refusing it", namespace)
        deps.metrics.injections.labels("error").inc()
        why = f"no answer within {budget:g}s" if isinstance(e, TimeoutError) else str(e)
        raise kopf.AdmissionError(
            "ckpt-operator could not inject the checkpoint agent into this pod of an opted-in "
            f"PyTorchJob ({why}); it is refused rather than run without checkpoints: the "
            "training-operator retries it. Check the ckpt-operator's logs.",
            code=503,
        ) from None
    if outcome.result == "deferred":  # a TrainJob restart attempt not planned yet
        deps.metrics.injections.labels("deferred").inc()
        # plan it now (the JobSet watch may be silent, see Deps.attempts_seen)
        _rt(memo).trainjob_recovery.schedule(namespace, outcome.job)
        raise kopf.AdmissionError(f"ckpt-operator: {outcome.refusal}", code=503)
    warnings.extend(outcome.warnings)
    answer_with(patch, outcome.ops)


def on_label_job(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """``label-job``: opted-in jobs' pod templates get ``ckpt.dev/inject`` (see handlers doc)."""
    answer_with(patch, label_job_ops(_raw(body)))


def _runtime_patch(targets: list[str], body: Any) -> None:
    add_inject_patch(cast(dict[str, Any], body), targets)


async def on_label_trainjob(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """``label-trainjob``: an opted-in TrainJob's trainer pods get ``ckpt.dev/inject``
    through the operator's ``spec.runtimePatches`` entry (see handlers doc)."""
    targets = await trainjob_label_targets(_rt(memo).deps, _raw(body))
    if targets:
        patch.fns.append(functools.partial(_runtime_patch, targets))


# --------------------------------------------------------------------------- jobs


async def _track_job(
    deps: Deps,
    type: str | None,
    job: dict[str, Any],
    cache: ObjectCache,
    scheduler: RecoveryScheduler,
    observe: Callable[[dict[str, Any]], Awaitable[bool]],
) -> None:
    """An opted-in job's watch event: its cache entry, bookkeeping, recovery when due."""
    meta = meta_of(job)
    ns, name = str(meta.namespace), str(meta.name)
    if type == "DELETED":
        scheduler.cancel(ns, name)
        cache.remove(ns, name)
        deps.peer_maps.forget(str(meta.uid or ""))
        return
    cache.upsert(job)
    if await observe(job):
        scheduler.schedule(ns, name)


async def on_job_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    observe = functools.partial(observe_job, rt.deps)
    await _track_job(rt.deps, type, _raw(body), rt.deps.jobs, rt.recovery, observe)
    if type == "DELETED":
        rt.memory.evicted()


async def on_trainjob_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    observe = functools.partial(observe_trainjob, rt.deps)
    trainjob = _raw(body)
    await _track_job(rt.deps, type, trainjob, rt.deps.trainjobs, rt.trainjob_recovery, observe)
    if type == "DELETED":
        meta = meta_of(trainjob)
        rt.deps.attempts_seen.forget(str(meta.namespace), str(meta.name))
        rt.memory.evicted()


async def on_jobset_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A TrainJob's JobSet: its ``status.restarts`` is the restart attempt to plan."""
    rt = _rt(memo)
    jobset = _raw(body)
    meta = meta_of(jobset)
    ns, name = str(meta.namespace), str(meta.name)
    if type == "DELETED":
        rt.deps.jobsets.remove(ns, name)
        return
    if jobset_trainjob(jobset) != name:  # not a TrainJob's (Trainer names it after it)
        return
    rt.deps.jobsets.upsert(jobset)
    trainjob = rt.deps.trainjobs.get(ns, name)
    if trainjob is not None and attempt_due(rt.deps, trainjob) is not None:
        rt.trainjob_recovery.schedule(ns, name)


# --------------------------------------------------------------------------- disruption


async def on_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":
        return
    try:
        await signal_pod(_rt(memo).deps, _raw(body))
    except NotFoundError:  # deleted meanwhile (e.g. its job's deletion): nothing to ask
        log.debug("pod %s went before its save-now request", body.get("metadata", {}).get("name"))


async def _index_pod(type: str | None, pod: dict[str, Any], deps: Deps, index: PodIndex) -> None:
    """A training pod's watch event: the pod index (recovery reads it instead of listing),
    a report of an opted-in pod that runs without the agent, and its job's replica peer
    map once every rank is on a node."""
    if type == "DELETED":
        index.remove(pod)
        uid = str(meta_of(pod).uid or "")
        deps.reported_pods.forget(uid)
        deps.fenced_pods.forget(uid)
        deps.agent_answers.forget(uid)
        return
    index.upsert(pod)
    await report_unprotected(deps, pod)
    await report_fenced_pod(deps, pod)
    await publish_peer_map(deps, pod)


async def on_training_pod_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Every training-operator pod (see :func:`_index_pod`)."""
    rt = _rt(memo)
    await _index_pod(type, _raw(body), rt.deps, rt.deps.pods)
    if type == "DELETED":
        rt.memory.evicted()


async def on_trainjob_pod_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Opted-in TrainJobs' pods (labelled through the runtime patch; see
    :func:`_index_pod`): their reports, and pods of earlier attempts still terminating."""
    rt = _rt(memo)
    pod = _raw(body)
    await _index_pod(type, pod, rt.deps, rt.deps.trainjob_pods)
    if type == "DELETED":
        rt.memory.evicted()
        return
    # a pod that failed or is terminating: its JobSet is about to restart (the JobSet watch
    # may be silent, see behaviours.attempts.recover_trainjob)
    name = TRAINJOB.job_name_of_pod(pod)
    if name and pod_ended_at(pod) is not None:
        ns = str(meta_of(pod).namespace)
        if rt.deps.trainjobs.get(ns, name) is not None:
            rt.trainjob_recovery.schedule(ns, name)


async def on_node_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    deps = _rt(memo).deps
    if type == "DELETED":  # its pool is kept: the failures of its pods still count
        deps.node_signals.forget(str(meta_of(body).name))
        deps.node_labels.forget(str(meta_of(body).name))
        return
    node = _raw(body)
    deps.pools.note_node(node, deps.config.recovery.node_pool_labels)
    meta = meta_of(node)
    deps.node_labels.note(str(meta.name), meta.labels, (ZONE_LABEL, deps.config.replica_rack_label))
    await signal_node(deps, node)


# --------------------------------------------------------------------------- registration


def register(
    registry: kopf.OperatorRegistry, *, webhooks: bool = True, kueue: bool = False
) -> kopf.OperatorRegistry:
    """Register every handler on ``registry`` (``webhooks=False``: no admission handlers;
    ``kueue``: the Kueue Workload handlers)."""
    kopf.on.startup(registry=registry)(on_startup)
    kopf.on.cleanup(registry=registry)(on_cleanup)
    kopf.on.probe(id="ckpt", registry=registry)(on_probe)

    for decorator in (kopf.on.create, kopf.on.update, kopf.on.resume):
        decorator(*POLICY, registry=registry, id="reconcile")(on_policy)
    kopf.on.event(*POLICY, registry=registry, id="track")(on_policy_event)

    kopf.on.event(
        *PYTORCHJOB,
        annotations={c.ANN_POLICY: kopf.PRESENT},
        registry=registry,
        id="job",
    )(on_job_event)
    kopf.on.event(
        "v1", "pods", labels={c.LABEL_INJECTED: "true"}, registry=registry, id="disruption"
    )(on_pod_event)
    kopf.on.event(
        "v1", "pods", labels={c.LABEL_TO_JOB_NAME: kopf.PRESENT}, registry=registry, id="pods"
    )(on_training_pod_event)
    kopf.on.event(
        *TRAINJOBS,
        annotations={c.ANN_POLICY: kopf.PRESENT},
        registry=registry,
        id="trainjob",
    )(on_trainjob_event)
    kopf.on.event(*JOBSETS, registry=registry, id="jobset")(on_jobset_event)
    kopf.on.event(
        "v1",
        "pods",
        labels={c.LABEL_JOBSET_NAME: kopf.PRESENT, c.LABEL_INJECT: "true"},
        registry=registry,
        id="trainjob-pods",
    )(on_trainjob_pod_event)
    kopf.on.event("v1", "nodes", registry=registry, id="drain")(on_node_event)
    if kueue:
        register_kueue(registry, lambda memo: _rt(memo).deps)

    if webhooks:
        kopf.on.mutate(
            "v1",
            "pods",
            id=c.WEBHOOK_INJECT_ID,
            operations=["CREATE"],
            side_effects=True,
            ignore_failures=False,
            labels={c.LABEL_INJECT: "true"},
            registry=registry,
        )(on_mutate_pod)
        kopf.on.mutate(
            *PYTORCHJOB,
            id=c.WEBHOOK_LABEL_JOB_ID,
            operations=["CREATE"],
            annotations={c.ANN_POLICY: kopf.PRESENT},
            registry=registry,
        )(on_label_job)
        kopf.on.validate(
            *POLICY,
            id=c.WEBHOOK_VALIDATE_ID,
            operations=["CREATE", "UPDATE"],
            registry=registry,
        )(on_validate_policy)
        kopf.on.validate(
            *PYTORCHJOB,
            id=c.WEBHOOK_VALIDATE_JOB_ID,
            operations=["CREATE", "UPDATE"],
            registry=registry,
        )(on_validate_job)
        kopf.on.mutate(
            *TRAINJOBS,
            id=c.WEBHOOK_LABEL_TRAINJOB_ID,
            operations=["CREATE"],
            annotations={c.ANN_POLICY: kopf.PRESENT},
            registry=registry,
        )(on_label_trainjob)
        kopf.on.validate(
            *TRAINJOBS,
            id=c.WEBHOOK_VALIDATE_TRAINJOB_ID,
            operations=["CREATE", "UPDATE"],
            registry=registry,
        )(on_validate_job)
    return registry
