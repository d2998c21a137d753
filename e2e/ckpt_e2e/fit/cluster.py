"""FIT scenarios 4–6: faults that involve the operator and the control plane.

Everything is the real control plane of the e2e harness (:class:`~ckpt_e2e.LocalCluster`:
etcd, kube-apiserver, controller-manager, scheduler, kwok, training-operator) with the
chart installed by ``helm`` and the real operator (:class:`~ckpt_e2e.stack.Stack`),
started once per FIT run and shared (``ctx.shared("stack", ...)``; under pytest the
e2e session's stack is put there instead). Training pods are the example trainer with
the agent, run as local processes by :class:`~ckpt_e2e.kubelet.PodRunner`, writing to
the namespace's PVC folder; each scenario has its own namespace.

* ``operator-sigkill-mid-restart``: the training pod is SIGKILLed; the operator's
  create of the restart is held on the wire (an admission gate), the API server then
  stores it while the operator is frozen, and the operator is SIGKILLed before it
  learns so. Restarted, it must finish that restart exactly once (no second
  ``-r1``/``-r2``) and the job resume from the newest valid checkpoint.
* ``node-drain``: ``kubectl cordon`` (the operator asks the pod to save now) then
  ``kubectl drain`` (eviction → SIGTERM → the agent saves again, exits 143); the
  restart resumes from that last emergency checkpoint on a spare node: no step lost.
* ``node-lost``: the node dies with the pod: every process of the container SIGKILLed,
  nothing reported (no kubelet left), the node ``NotReady`` (kwok lets go of it; its
  ``Ready`` condition goes ``Unknown`` as the node lifecycle controller would set it
  after its grace period) and tainted ``node.kubernetes.io/out-of-service`` as an
  administrator or cloud controller does for a node that is gone. The real taint
  eviction and pod GC remove the pod, the training-operator fails the job, and the
  operator restarts it from the newest valid checkpoint on a spare node.

Simulated: only the node's death itself (kwok nodes run nothing), the ``Unknown``
condition written at once instead of after ``node-monitor-grace-period``, and the
out-of-service taint an operator or cloud controller would add.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt_agent.persist.validate import load_check

from ..admission import AdmissionGate
from ..cluster import LocalCluster
from ..errors import ApiError
from ..kubelet import PodRun
from ..scenario import Scenario
from ..stack import Stack
from ..training import (
    StorageView,
    Training,
    annotations_of,
    events,
    last_logged_step,
    list_jobs,
    loss_log_path,
    result_path,
)
from .core import FitContext, Outcome, scenario
from .trainer import reference

#: A small run: a pulse every 10 steps (1 s), ~6 s of training in all.
TRAINING = Training(steps=60, seed=7, step_sleep=0.1, samples=512)
POLICY = "fit"
#: Nothing expires during a scenario: every acknowledged checkpoint must still be there.
RETENTION = {"routineKeep": 100, "importantKeep": 100}
POOL_LABEL = "fit.ckpt.dev/pool"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
#: terminationGracePeriodSeconds of the pod on the node that is lost.
LOST_GRACE_S = 10


# --------------------------------------------------------------------------- services
def control_plane(ctx: FitContext) -> Stack:
    """The run's control plane with the chart and the operator (started on first use);
    the operator is started again if a previous scenario left it dead."""

    def start() -> Stack:
        ctx.log("cluster: starting the local control plane and installing the chart")
        cluster = LocalCluster(startup_timeout=180).start()
        try:
            return Stack.up(cluster)
        except BaseException:
            cluster.stop()
            raise

    def stop(stack: Stack) -> None:
        try:
            stack.down()
        finally:
            stack.cluster.stop()

    stack = ctx.shared("stack", start, stop)
    if not stack.operator.running:
        stack.operator.start()
    return stack


def namespace(ctx: FitContext, stack: Stack, name: str) -> Scenario:
    """A fresh namespace with the checkpoint PVC (deleted after the scenario)."""
    ns = f"fit-{name}-{uuid.uuid4().hex[:5]}"[:63]
    stack.cluster.create_namespace(ns)
    ctx.cleanups.append(lambda: stack.cluster.delete_namespace(ns, wait=False))
    sc = Scenario(stack.cluster, ns, stack.operator)
    ctx.cleanups.append(sc.close)
    return sc


def node_pool() -> dict[str, str]:
    """A node selector for a fresh pool of kwok nodes (label :data:`POOL_LABEL`)."""
    return {POOL_LABEL: f"fit-{uuid.uuid4().hex[:6]}"}


def add_node(ctx: FitContext, cluster: LocalCluster, name: str, pool: dict[str, str]) -> None:
    """A kwok node in ``pool`` (deleted after the scenario)."""

    def delete() -> None:
        cluster.kubectl("delete", "node", name, "--ignore-not-found", check=False)

    ctx.cleanups.append(delete)
    cluster.create_node(name, labels=pool)


# --------------------------------------------------------------------------- observations
@dataclass
class Fault:
    """What the scenario knew when the fault hit."""

    acknowledged: list[str]
    """Valid checkpoints at that moment (none may be lost)."""
    expected_from: str | None
    """The checkpoint the recovery must resume from."""
    last_step: int
    """The last step the failed pod logged."""
    detected: float
    """``time.monotonic()`` when the failure was detected."""


def freeze_and_look(sc: Scenario, view: StorageView, run: PodRun, run_id: str) -> Fault:
    """Freeze the pod (nothing new gets written) and record what is valid now."""
    assert run.local is not None
    run.local.signal_container(signal.SIGSTOP)
    valid = view.valid(run_id)
    return Fault(
        acknowledged=[r.id for r in valid],
        expected_from=valid[-1].id if valid else None,
        last_step=last_logged_step(sc.results, run.pod),
        detected=0.0,
    )


def wait_valid(sc: Scenario, view: StorageView, run: PodRun, run_id: str, step: int) -> None:
    def ready() -> bool:
        if not run.running:
            raise AssertionError(f"pod {run.name} ended early ({run.exit_code})")
        newest = view.newest_valid(run_id)
        return newest is not None and newest.step >= step

    sc.cluster.wait_for(ready, timeout=120, what=f"a valid checkpoint at step >= {step}")


def check_recovery(
    ctx: FitContext,
    outcome: Outcome,
    sc: Scenario,
    view: StorageView,
    run_id: str,
    runs: tuple[PodRun, PodRun],
    fault: Fault,
) -> None:
    """The shared pass criteria for the restarted pod of ``runs`` (failed, restarted;
    issue #14): the losses of both, the restart's winning, are the reference's."""
    failed, restart = runs

    def stepping() -> bool:
        if not restart.running and restart.exit_code not in (None, 0):
            raise AssertionError(f"the restarted pod exited {restart.exit_code}")
        return last_logged_step(sc.results, restart.pod) >= 0

    try:
        sc.cluster.wait_for(stepping, timeout=120, what="the restarted pod training")
        outcome.check_recovery_time(time.monotonic() - fault.detected)
    except (TimeoutError, AssertionError) as e:
        outcome.check_recovery_time(None)
        outcome.notes.append(str(e))
    code = restart.wait(180)
    try:
        result: dict[str, Any] = json.loads(result_path(sc.results, restart.pod).read_text())
    except (OSError, ValueError):
        result = {}
    outcome.check("recovered automatically", code == 0 and bool(result), f"exit {code}")
    if not result:
        return
    resume = result.get("resume") or {}
    outcome.recovered_from = resume.get("checkpoint_id")
    outcome.steps_lost = max(0, fault.last_step + 1 - int(result.get("first_step", 0)))
    outcome.check(
        "resumed from the newest valid checkpoint",
        outcome.recovered_from == fault.expected_from,
        f"{outcome.recovered_from} (expected {fault.expected_from})",
    )
    ref = reference(ctx, TRAINING)
    losses = _logged_losses(sc, failed)
    losses.update({int(s): float.fromhex(v) for s, v in (result.get("losses") or {}).items()})
    outcome.check_losses(losses, ref["losses"], exact=bool(resume.get("exact", True)))
    outcome.check(
        "final parameters == reference",
        result.get("final_params_sha256") == ref["params"],
        str(result.get("final_params_sha256", ""))[:16],
    )
    valid = view.valid(run_id)
    lost = sorted(set(fault.acknowledged) - {r.id for r in valid})
    outcome.check(
        "no acknowledged checkpoint lost",
        not lost,
        f"{len(fault.acknowledged)} acknowledged, lost: {lost or 'none'}",
    )
    bad = [r.id for r in valid if not load_check(view.storage, run_id, r.id).ok]
    outcome.check("no corrupt checkpoint marked valid", not bad, f"{bad or 'none'}")


def _logged_losses(sc: Scenario, run: PodRun) -> dict[int, float]:
    """The losses a pod's process logged step by step (survives a SIGKILL)."""
    out: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for line in loss_log_path(sc.results, run.pod).read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                entry = json.loads(line)
                out[int(entry["step"])] = float.fromhex(entry["loss"])
    return out


def _mark(outcome: Outcome, t0: float, what: str) -> None:
    """Note when a phase ended (seconds since the scenario began), for the report."""
    outcome.notes.append(f"{what} at +{time.monotonic() - t0:.1f}s")


def _restarts(sc: Scenario) -> list[str]:
    return sorted(j["metadata"]["name"] for j in list_jobs(sc.cluster, sc.namespace))


def _start(
    ctx: FitContext,
    name: str,
    pool: dict[str, str] | None = None,
    grace: int = 30,
    **policy: Any,
) -> tuple[Scenario, StorageView, PodRun, str]:
    """Namespace, policy, the job ``train`` submitted (on ``pool``, pods with ``grace``
    seconds of termination grace) and its first pod."""
    stack = control_plane(ctx)
    reference(ctx, TRAINING)  # before the job: it then has both CPUs
    sc = namespace(ctx, stack, name)
    sc.apply_policy(POLICY, recovery={"backoffSeconds": 0}, retention=RETENTION, **policy)
    view = sc.view()
    runner = sc.runner()
    sc.submit("train", TRAINING, policy=POLICY, node_selector=pool, termination_grace_seconds=grace)
    first = runner.wait_run("train")
    return sc, view, first, sc.run_id("train")


# --------------------------------------------------------------------------- scenario 4
@scenario(
    "operator-sigkill-mid-restart",
    "4. operator SIGKILLed while its create of the restart is in flight",
    needs=("cluster",),
    expected_s=45.0,
)
def operator_sigkill_mid_restart(ctx: FitContext) -> Outcome:
    outcome = Outcome("operator-sigkill-mid-restart")
    t0 = time.monotonic()
    sc, view, first, run_id = _start(ctx, "opkill")
    _mark(outcome, t0, "first pod running")
    cluster, op = sc.cluster, sc.operator
    wait_valid(sc, view, first, run_id, 20)
    with AdmissionGate(cluster, sc.namespace) as gate:
        gate.hold(r"train-r\d+")
        fault = freeze_and_look(sc, view, first, run_id)
        assert first.local is not None
        first.local.kill()
        first.wait(30)
        fault.detected = time.monotonic()
        _mark(outcome, t0, "pod killed")
        gate.wait_held("train-r1")
        decision = annotations_of(sc.job("train")).get("ckpt.dev/restart-decision", "")
        outcome.injected_at = f"step {fault.last_step}: restart create of train-r1 in flight"
        op.freeze()  # the create lands while the operator cannot hear the answer ...
        gate.stop_holding()
        gate.release("train-r1", allow=True)
        cluster.wait_for(lambda: sc.job("train-r1"), timeout=30, what="train-r1 stored")
        op.kill()  # ... and it dies before it does
        outcome.check(
            "the restart decision was written before the create",
            '"train-r1"' in decision,
            decision[:80] or "none",
        )
        op.start()
    restarted = sc.wait_operator_state("train", "Restarted", timeout=60)
    _mark(outcome, t0, "operator back, restart recorded")
    second = sc.runners[0].wait_run("train-r1", timeout=90)
    check_recovery(ctx, outcome, sc, view, run_id, (first, second), fault)
    jobs = _restarts(sc)
    outcome.check("exactly one restart", jobs == ["train", "train-r1"], f"jobs: {jobs}")
    count = len(events(cluster, sc.namespace, name="train", reason="Restarted"))
    outcome.check("one Restarted event", count == 1, f"{count}; state {restarted.get('state')}")
    return outcome


@dataclass
class NodeJob:
    """The job ``train`` pinned to a node pool of its own: ``node`` at first, ``spare``
    added (:meth:`add_spare`) for the restart to land on."""

    sc: Scenario
    view: StorageView
    first: PodRun
    run_id: str
    node: str
    spare: str
    pool: dict[str, str]

    def add_spare(self, ctx: FitContext) -> None:
        add_node(ctx, self.sc.cluster, self.spare, self.pool)

    def restart(self, outcome: Outcome, t0: float) -> PodRun:
        """Wait for the operator's restart and its pod; check it runs on the spare node."""
        job = self.sc.wait_restart("train", timeout=90)
        _mark(outcome, t0, "restart created")
        second = self.sc.runners[0].wait_run(job["metadata"]["name"], timeout=90)
        where = second.pod["spec"].get("nodeName")
        outcome.check("restart on the spare node", where == self.spare, str(where))
        return second


def _job_on_own_node(
    ctx: FitContext, outcome: Outcome, t0: float, kind: str, **start: Any
) -> NodeJob:
    stack = control_plane(ctx)
    tag = uuid.uuid4().hex[:5]
    node, spare = f"fit-{kind}-{tag}", f"fit-spare-{tag}"
    pool = node_pool()
    add_node(ctx, stack.cluster, node, pool)
    sc, view, first, run_id = _start(ctx, kind, pool, **start)
    _mark(outcome, t0, "first pod running")
    return NodeJob(sc, view, first, run_id, node, spare, pool)


# --------------------------------------------------------------------------- scenario 5
@scenario(
    "node-drain",
    "5. node drain: emergency saves before the pod goes, resume on another node",
    needs=("cluster",),
    expected_s=45.0,
)
def node_drain(ctx: FitContext) -> Outcome:
    outcome = Outcome("node-drain")
    t0 = time.monotonic()
    # scheduled pulses are rare, so the emergency saves stand out
    job = _job_on_own_node(ctx, outcome, t0, "drain", pulse_every=50, full_every=1000)
    sc, view, first, run_id, node = job.sc, job.view, job.first, job.run_id, job.node
    cluster = sc.cluster
    sc.wait_step(first, 10)
    job.add_spare(ctx)

    t_cordon = time.time()
    cluster.kubectl("cordon", node)

    def emergency(after: float, why: str) -> list[Any]:
        return [r for r in view.since(run_id, after) if r.emergency and why in r.reason.lower()]

    try:
        cluster.wait_for(lambda: emergency(t_cordon, "save-now"), timeout=30, what="save-now")
        outcome.check("emergency save on cordon (pod still running)", first.running, "")
    except TimeoutError as e:
        outcome.check("emergency save on cordon (pod still running)", False, str(e))
    t_drain = time.time()
    outcome.injected_at = f"drain at step {last_logged_step(sc.results, first.pod)}"
    cluster.drain(node)
    code = first.wait(60)
    fault = Fault([], None, last_logged_step(sc.results, first.pod), time.monotonic())
    ended = time.time()
    _mark(outcome, t0, "drained pod ended")
    saves = emergency(t_drain, "sigterm")
    last = max(saves, key=lambda r: r.step) if saves else None
    outcome.check(
        "emergency save on SIGTERM committed before the pod ended",
        code == 143 and last is not None and last.created_at <= ended,
        f"exit {code}, {last.id if last else 'no SIGTERM checkpoint'}",
    )
    fault.acknowledged = [r.id for r in view.valid(run_id)]
    fault.expected_from = last.id if last else None
    second = job.restart(outcome, t0)
    check_recovery(ctx, outcome, sc, view, run_id, (first, second), fault)
    outcome.check("no step lost", outcome.steps_lost == 0, f"{outcome.steps_lost}")
    return outcome


# --------------------------------------------------------------------------- scenario 6
def cut_off_node(
    cluster: LocalCluster, node: str, *, released: Callable[[], None] | None = None
) -> None:
    """The node is lost to the control plane: kwok lets go of it (then ``released`` runs:
    what becomes of its pods), its ``Ready`` condition goes ``Unknown`` (as the node
    lifecycle controller sets it), and it gets the out-of-service taint."""
    cluster.kubectl("annotate", "node", node, "kwok.x-k8s.io/node-")  # kwok lets go of it
    if released is not None:
        released()
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    unknown = {
        "type": "Ready",
        "status": "Unknown",
        "reason": "NodeStatusUnknown",
        "message": "Kubelet stopped posting node status.",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    cluster.kubectl(
        "patch",
        "node",
        node,
        "--subresource=status",
        "--type=strategic",
        "-p",
        json.dumps({"status": {"conditions": [unknown]}}),
    )
    cluster.kubectl("taint", "node", node, f"{OUT_OF_SERVICE}=nodeshutdown:NoExecute")


def lose_node(cluster: LocalCluster, node: str, run: PodRun) -> None:
    """The node dies with the pod (see the module docstring)."""
    assert run.local is not None
    cut_off_node(cluster, node, released=run.local.lose_node)


def _pod_fate(sc: Scenario, name: str) -> tuple[bool, str]:
    """(evicted, how): the pod is gone (pod GC) or terminating (taint eviction)."""
    try:
        pod = sc.cluster.request("GET", f"/api/v1/namespaces/{sc.namespace}/pods/{name}")
    except ApiError as e:
        return e.status == 404, "deleted (pod GC)" if e.status == 404 else str(e)
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
    return bool(deleting), f"terminating since {deleting}" if deleting else "still there"


@scenario(
    "node-lost",
    "6. node lost without warning: pod SIGKILLed, no SIGTERM, node NotReady",
    needs=("cluster",),
    expected_s=60.0,
)
def node_lost(ctx: FitContext) -> Outcome:
    outcome = Outcome("node-lost")
    t0 = time.monotonic()
    # a short grace period: the operator stops waiting for a pod that never reports at
    # its deletion time plus a margin (the pod GC may remove it sooner)
    job = _job_on_own_node(ctx, outcome, t0, "lost", grace=LOST_GRACE_S)
    sc, view, first, run_id = job.sc, job.view, job.first, job.run_id
    wait_valid(sc, view, first, run_id, 20)
    job.add_spare(ctx)
    fault = freeze_and_look(sc, view, first, run_id)
    outcome.injected_at = f"node lost at step {fault.last_step}"
    lose_node(sc.cluster, job.node, first)
    fault.detected = time.monotonic()
    _mark(outcome, t0, "node lost")
    second = job.restart(outcome, t0)
    silent = first.local is not None and first.local.reported_status is None
    outcome.check("the lost pod's exit never reported", silent)
    outcome.check("evicted by the control plane", *_pod_fate(sc, first.name))
    check_recovery(ctx, outcome, sc, view, run_id, (first, second), fault)
    return outcome
