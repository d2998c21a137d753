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
Pod (mutating webhook)      ``inject-pods``: CREATE of labelled pods → JSON Patch (from the watch
                            caches, within ``--webhook-budget``; fails closed)
Pod (training, events)      pod index for recovery; reports opted-in pods running uninjected
Pod (injected, events)      DisruptionTarget / deletion → ``ckpt.dev/save-now``
Node (events)               cordon / going-away taint / NotReady / pressure → a node warning in
                            ``ckpt.dev/save-now`` on its pods; calm again → its clearing
probe                       liveness details (loops, tracked policies, active recoveries)
==========================  ==================================================================
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any, cast

import kopf

from ckpt_operator import constants as c
from ckpt_operator.behaviours.admission import (
    inject_pod,
    label_job,
    report_unprotected,
    validate_job,
    validate_policy,
)
from ckpt_operator.behaviours.agentcheck import check_agents
from ckpt_operator.behaviours.deps import Deps, cached_job
from ckpt_operator.behaviours.disruption import signal_node, signal_pod
from ckpt_operator.behaviours.policies import reconcile_policy
from ckpt_operator.behaviours.recovery import observe_job, recover_job
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.jsonpatch import JSONPatchOp, apply_patch_in_place
from ckpt_operator.loops import RecoveryScheduler, RetentionLoop

__all__ = ["Runtime", "make_runtime", "register"]

POLICY = ("ckpt.dev", "v1alpha1", "checkpointpolicies")
PYTORCHJOB = (c.PYTORCHJOB_GROUP, c.PYTORCHJOB_VERSION, c.PYTORCHJOB_PLURAL)
MEMO_KEY = "ckpt"

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """The operator's shared state (in kopf's memo)."""

    deps: Deps
    recovery: RecoveryScheduler
    retention: RetentionLoop


def make_runtime(deps: Deps) -> Runtime:
    async def recover(job: dict[str, Any]) -> float | None:
        return await recover_job(deps, job)

    async def reconcile(policy: dict[str, Any]) -> object:
        status = await reconcile_retention(deps, policy)
        await check_agents(deps, policy)
        return status

    return Runtime(
        deps=deps,
        # the job as the watch (or the operator's own last write) left it; a GET on a miss
        recovery=RecoveryScheduler(
            functools.partial(cached_job, deps),
            recover,
            error_backoff_s=deps.config.recovery.error_backoff_s,
        ),
        retention=RetentionLoop(reconcile, clock=deps.clock, tick_s=deps.config.retention.tick_s),
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
    await rt.retention.stop()
    await rt.recovery.stop()


def on_probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    rt = _rt(memo)
    return {
        "policies": len(rt.retention.policies),
        "retentionPasses": rt.retention.passes,
        "retentionLastError": rt.retention.last_error,
        "activeRecoveries": len(rt.recovery.active),
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
    meta = body.get("metadata") or {}
    if type == "DELETED":
        rt.retention.remove(str(meta.get("namespace")), str(meta.get("name")))
        rt.deps.policies.remove(str(meta.get("namespace")), str(meta.get("name")))
    else:
        rt.retention.upsert(_raw(body))
        rt.deps.policies.upsert(_raw(body))


def on_validate_policy(spec: kopf.Spec, **_: Any) -> None:
    errors = validate_policy(dict(spec))
    if errors:
        raise kopf.AdmissionError("invalid CheckpointPolicy: " + "; ".join(errors), code=422)


def on_validate_job(body: kopf.Body, old: kopf.Body | None = None, **_: Any) -> None:
    errors = validate_job(_raw(body), _raw(old) if old is not None else None)
    if errors:
        raise kopf.AdmissionError("invalid PyTorchJob: " + "; ".join(errors), code=422)


# --------------------------------------------------------------------------- pods: injection


def _apply(ops: list[JSONPatchOp], body: Any) -> None:
    apply_patch_in_place(cast(dict[str, Any], body), ops)


async def on_mutate_pod(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    warnings: list[str],
    dryrun: bool = False,
    **_: Any,
) -> None:
    pod = _raw(body)
    namespace = str((pod.get("metadata") or {}).get("namespace") or "")
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
    warnings.extend(outcome.warnings)
    if outcome.ops:
        patch.fns.append(functools.partial(_apply, outcome.ops))


def _label_templates(body: Any) -> None:
    label_job(cast(dict[str, Any], body))


def on_label_job(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """``label-job``: opted-in jobs' pod templates get ``ckpt.dev/inject`` (see handlers doc)."""
    if label_job(copy.deepcopy(_raw(body))):
        patch.fns.append(_label_templates)


# --------------------------------------------------------------------------- jobs


async def on_job_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    rt = _rt(memo)
    job = _raw(body)
    meta = job.get("metadata") or {}
    ns, name = str(meta.get("namespace")), str(meta.get("name"))
    if type == "DELETED":
        rt.recovery.cancel(ns, name)
        rt.deps.jobs.remove(ns, name)
        return
    rt.deps.jobs.upsert(job)
    if await observe_job(rt.deps, job):
        rt.recovery.schedule(ns, name)


# --------------------------------------------------------------------------- disruption


async def on_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":
        return
    await signal_pod(_rt(memo).deps, _raw(body))


async def on_training_pod_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Every training-operator pod: the pod index (recovery reads it instead of listing),
    and a report of opted-in pods that run without the agent."""
    deps = _rt(memo).deps
    pod = _raw(body)
    if type == "DELETED":
        deps.pods.remove(pod)
        deps.reported_pods.discard(str((pod.get("metadata") or {}).get("uid") or ""))
        return
    deps.pods.upsert(pod)
    await report_unprotected(deps, pod)


async def on_node_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    deps = _rt(memo).deps
    if type == "DELETED":
        deps.node_signals.pop(str((body.get("metadata") or {}).get("name")), None)
        return
    await signal_node(deps, _raw(body))


# --------------------------------------------------------------------------- registration


def register(registry: kopf.OperatorRegistry, *, webhooks: bool = True) -> kopf.OperatorRegistry:
    """Register every handler on ``registry`` (``webhooks=False``: no admission handlers)."""
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
    kopf.on.event("v1", "nodes", registry=registry, id="drain")(on_node_event)

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
    return registry
