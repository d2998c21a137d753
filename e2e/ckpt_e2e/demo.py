"""The demo: install everything, train, crash it, watch it resume — on a real control plane.

``scripts/demo.sh`` (= ``scripts/setup.sh --tools`` then ``python -m ckpt_e2e.demo``):

1. brings up the local control plane (etcd, kube-apiserver, controller-manager,
   scheduler, kwok, Kubeflow training-operator; binaries from the cached Go build);
2. ``helm install``\\ s ``charts/ckpt-operator`` and starts the operator in its
   Deployment's place, as the chart's ServiceAccount (``ckpt_e2e.stack``);
3. ``kubectl apply``\\ s a sample CheckpointPolicy (``examples/policy.yaml`` with
   demo-sized intervals; local storage on a PVC, no S3 needed);
4. runs an annotated PyTorchJob: ``examples/train_mnist_like.py``, a small real PyTorch
   model on the CPU, checkpointing through the injected agent;
5. SIGKILLs the training mid-run, then shows the operator's automatic resume (Events as
   they happen, training progress);
6. ends with a summary (steps, checkpoints by tier, resume point, time to recover, the
   final loss against an uninterrupted run) and where the report and logs are, under
   ``demo-output/<time>/``: ``ckpt report`` of the run (HTML and ``--json``, every pod's
   logs merged, one ``--work-dir`` each) and ``ckpt report --all`` over its storage;
   tears everything down (``--keep`` leaves it running).

:func:`run_demo` is the core (after the stack is up); the e2e suite runs it against its
own cluster so the demo cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from ckpt_agent.cli.main import main as ckpt_main
from ckpt_agent.report import LOG_GLOB, SIDECAR_GLOB

from .api import free_port
from .cluster import LocalCluster
from .errors import ClusterError
from .kubelet import PodRun
from .scenario import Scenario
from .stack import Stack
from .tools import REPO_ROOT
from .training import (
    Training,
    annotations_of,
    condition,
    event_lines,
    events,
    final_loss,
    last_logged_step,
    reference_run,
    result_path,
)

DEFAULT_OUTPUT = REPO_ROOT / "demo-output"
DEMO_NAMESPACE = "ckpt-demo"
DEMO_TRAINING = Training(steps=150, seed=0, step_sleep=0.08)


class Printer:
    """Progress lines with the time since the demo started."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.color = out.isatty() and os.environ.get("NO_COLOR") is None

    def __call__(self, text: str = "", *, style: str = "") -> None:
        codes = {"title": "1;34", "ok": "1;32", "warn": "1;33", "bad": "1;31", "dim": "2"}
        stamp = f"[{time.monotonic() - self.t0:6.1f}s]"
        if self.color and style in codes:
            text = f"\033[{codes[style]}m{text}\033[0m"
        print(f"{stamp} {text}" if text else "", file=self.out, flush=True)


@dataclass
class DemoResult:
    """What the demo measured (also written to ``report.json``)."""

    namespace: str
    job: str
    restart: str
    run_id: str
    steps: int
    killed_at_step: int
    resume_from: str
    resume_step: int
    seconds_to_restart_job: float
    """SIGKILL → the operator created the restarted PyTorchJob."""
    seconds_to_resume: float
    """SIGKILL → the restarted pod's first training step."""
    final_loss: float
    reference_final_loss: float
    same_final_params: bool
    checkpoints_by_tier: dict[str, list[int]] = field(default_factory=dict)
    heartbeat_ring: list[int] = field(default_factory=list)
    storage_url: str = ""
    events: list[str] = field(default_factory=list)
    output_dir: str = ""
    logs_dir: str = ""
    pods_dir: str = ""
    checkpointing_report: str = ""
    """``ckpt report`` of the run (HTML)."""
    checkpointing_json: str = ""
    """``ckpt report --json`` of the run."""
    fleet_report: str = ""
    """``ckpt report --all`` over the demo's storage (HTML; ``.json`` next to it)."""
    report_command: str = ""
    """The ``ckpt report`` command line that made :attr:`checkpointing_report`."""

    @property
    def exact(self) -> bool:
        return self.same_final_params and self.final_loss == self.reference_final_loss


def sample_policy(scenario: Scenario, name: str = "demo") -> dict[str, Any]:
    """``examples/policy.yaml`` with demo-sized intervals and the demo's PVC as storage."""
    policy: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "policy.yaml").read_text())
    policy["metadata"]["name"] = name
    spec = policy["spec"]
    spec["tiers"]["pulse"] = {"baseInterval": 20, "minInterval": 5, "maxInterval": 40}
    spec["tiers"]["full"] = {"everySteps": 50}
    spec["storage"] = scenario.local_storage()
    spec["retention"] |= {"routineKeep": 3, "reconcileIntervalSeconds": 10}
    spec["recovery"] |= {"backoffSeconds": 2}
    # every "pod" shares this machine's network: its own agent metrics port
    spec["agent"] = {"metricsPort": free_port()}
    return policy


def run_demo(
    cluster: LocalCluster,
    stack: Stack,
    output: Path,
    *,
    namespace: str = DEMO_NAMESPACE,
    training: Training = DEMO_TRAINING,
    say: Callable[..., None] | None = None,
    timeout: float = 300.0,
) -> DemoResult:
    """Policy → annotated PyTorchJob → SIGKILL → automatic resume → summary and report."""
    say = say or Printer()
    output.mkdir(parents=True, exist_ok=True)
    if cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        cluster.create_namespace(namespace)
    scenario = Scenario(cluster, namespace, stack.operator)
    try:
        return _run(scenario, stack, output, training, say, timeout)
    finally:
        (output / "events.txt").write_text(event_lines(cluster, namespace) + "\n")
        scenario.close()


def _run(
    scenario: Scenario,
    stack: Stack,
    output: Path,
    training: Training,
    say: Callable[..., None],
    timeout: float,
) -> DemoResult:
    cluster, ns = scenario.cluster, scenario.namespace
    policy = sample_policy(scenario)
    say("kubectl apply -f policy.yaml  (examples/policy.yaml, demo-sized intervals)", style="title")
    (output / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    cluster.apply(policy, namespace=ns)
    ready = scenario.wait_policy_ready("demo")
    tiers = ready["spec"]["tiers"]
    say(
        f"  policy demo Ready: heartbeat every {tiers['heartbeat']['everySteps']} step, "
        f"pulse every {tiers['pulse']['minInterval']}-{tiers['pulse']['maxInterval']} steps "
        f"(adaptive), full every {tiers['full']['everySteps']}; storage {scenario.store}"
    )

    say("kubectl apply -f pytorchjob.yaml  (annotated: ckpt.dev/policy=demo, auto-resume)")
    runner = scenario.runner()
    scenario.submit("mnist", training, policy="demo")
    first = runner.wait_run("mnist", timeout=120)
    run_id = scenario.run_id("mnist")
    env = {e["name"]: e.get("value") for e in first.pod["spec"]["containers"][0]["env"]}
    say(
        f"  pod {first.name} admitted with the agent injected: CKPT_RUN_ID={env['CKPT_RUN_ID']}, "
        f"CKPT_STORAGE_URL={env['CKPT_STORAGE_URL']}"
    )
    view = scenario.view()
    kill_at = int(training.steps * 0.6)
    say(f"training {training.steps} steps on the CPU; a SIGKILL comes at step ~{kill_at}")

    # ---- train, then crash it
    shown = -1
    deadline = time.monotonic() + timeout
    while True:
        _check(first, deadline, "the first run to reach the kill point")
        step = last_logged_step(scenario.results, first.pod)
        newest = view.newest_valid(run_id)
        if step // 20 > shown // 20 and step >= 0:
            shown = step
            say(f"  step {step:4d}  {_ckpt_line(view, run_id)}", style="dim")
        if step >= kill_at and newest is not None:
            break
        time.sleep(0.2)
    assert first.local is not None
    killed_step = last_logged_step(scenario.results, first.pod)
    first.local.kill()
    t_kill = time.time()
    say(f"SIGKILL -> training container of {first.name} at step {killed_step}", style="bad")
    first.wait(30)

    # ---- the operator takes over
    seen: set[str] = set()

    def show_events() -> None:
        for e in events(cluster, ns, kind="PyTorchJob"):
            key = e["metadata"]["name"]
            if key in seen or e.get("reason", "").startswith(("SuccessfulCreate", "Exited")):
                continue
            seen.add(key)
            obj = e["involvedObject"]["name"]
            say(f"  event {obj}: {e['reason']}: {e.get('message', '')}", style="warn")

    for e in events(cluster, ns, kind="PyTorchJob"):  # what happened before the kill
        seen.add(e["metadata"]["name"])
    restart: dict[str, Any] | None = None
    while restart is None:
        _check(None, deadline, "the operator's restart", cluster)
        show_events()
        new = annotations_of(scenario.job("mnist")).get("ckpt.dev/restarted-as")
        restart = scenario.job(new) if new else None
        time.sleep(0.2)
    t_restart = time.time()
    name = restart["metadata"]["name"]
    ann = annotations_of(restart)
    say(
        f"operator restarted the job as {name}, resuming from {ann['ckpt.dev/resume-from']} "
        f"(step {ann['ckpt.dev/resume-step']}) after {t_restart - t_kill:.1f}s",
        style="ok",
    )
    second = runner.wait_run(name, timeout=120)
    t_first_step = 0.0
    shown = -1
    while second.running or second.exit_code is None:
        _check(None, deadline, "the resumed run", cluster)
        show_events()
        step = last_logged_step(scenario.results, second.pod)
        if step >= 0 and not t_first_step:
            t_first_step = time.time()
            say(f"  {second.name} resumed training at step {step} (CKPT_RESUME_FROM injected)")
        if step // 20 > shown // 20 and step >= 0:
            shown = step
            say(f"  step {step:4d}  {_ckpt_line(view, run_id)}", style="dim")
        time.sleep(0.2)
    code = second.wait(30)
    if code != 0:
        raise ClusterError(f"the resumed run exited {code}:\n{_log_tail(second)}")
    job = scenario.wait_finished(name, timeout=60)
    show_events()
    say(f"PyTorchJob {name} {'Succeeded' if condition(job, 'Succeeded') else 'Failed'}", style="ok")

    # ---- compare with an uninterrupted run and summarize
    say("computing the same run without any interruption (reference) ...")
    ref = reference_run(training, output / "reference")
    res = json.loads(result_path(scenario.results, second.pod).read_text())
    by_tier: dict[str, list[int]] = {}
    for r in view.checkpoints(run_id):
        by_tier.setdefault(r.tier.value, []).append(r.step)
    ring = [r.step for r in view.checkpoints(run_id, heartbeat=True) if r.tier.value == "heartbeat"]
    result = DemoResult(
        namespace=ns,
        job="mnist",
        restart=name,
        run_id=run_id,
        steps=training.steps,
        killed_at_step=killed_step,
        resume_from=str(res["resume"]["checkpoint_id"]),
        resume_step=int(res["resume"]["step"]) - 1,
        seconds_to_restart_job=round(t_restart - t_kill, 2),
        seconds_to_resume=round((t_first_step or time.time()) - t_kill, 2),
        final_loss=final_loss(res),
        reference_final_loss=final_loss(ref),
        same_final_params=res["final_params_sha256"] == ref["final_params_sha256"],
        checkpoints_by_tier={k: sorted(v) for k, v in sorted(by_tier.items())},
        heartbeat_ring=ring,
        storage_url=f"file://{scenario.store}/{run_id}",
        events=event_lines(cluster, ns).splitlines(),
        output_dir=str(output),
        logs_dir=str(cluster.log_dir),
        pods_dir=str(cluster.pods_dir / ns),
    )
    pods = cluster.pods_dir / ns
    _checkpointing_reports(result, scenario.store, pods, output)
    _write_report(result, output, stack)
    return result


def _check(
    run: PodRun | None, deadline: float, what: str, cluster: LocalCluster | None = None
) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"demo: timed out waiting for {what}")
    if run is not None and not run.running:
        raise ClusterError(f"the training ended before {what}:\n{_log_tail(run)}")
    if cluster is not None:
        cluster.check_alive()


def _log_tail(run: PodRun) -> str:
    return run.local.log_text()[-3000:] if run.local else ""


def _ckpt_line(view: Any, run_id: str) -> str:
    recs = view.checkpoints(run_id)
    if not recs:
        return "no checkpoint yet"
    parts = []
    for tier in ("pulse", "full"):
        steps = [r.step for r in recs if r.tier.value == tier]
        if steps:
            parts.append(f"{tier} x{len(steps)} (newest step {max(steps)})")
    return "checkpoints: " + ", ".join(parts)


def summary_text(result: DemoResult) -> str:
    tiers = "\n".join(
        f"    {tier:<9} {len(steps):2d} kept: steps {', '.join(map(str, steps))}"
        for tier, steps in result.checkpoints_by_tier.items()
    )
    verdict = (
        "identical to the uninterrupted run (loss and parameters, bit for bit)"
        if result.exact
        else "DIFFERENT from the uninterrupted run"
    )
    return f"""
Summary
  training            {result.steps} steps, SIGKILLed at step {result.killed_at_step}
  resume point        {result.resume_from} -> continued at step {result.resume_step + 1}
  time to recover     {result.seconds_to_restart_job:.1f}s to the restarted PyTorchJob \
({result.restart}), {result.seconds_to_resume:.1f}s to training again
  checkpoints         in {result.storage_url}
{tiers}
    heartbeat  newest step {max(result.heartbeat_ring, default="-")} (L0: step, data position, RNG)
  final loss          {result.final_loss:.6g}, {verdict}
  report              {result.output_dir}/report.md (and report.json, events.txt, policy.yaml)
  checkpointing       {result.checkpointing_report or "-"} (`ckpt report`: open in a browser)
                      {result.checkpointing_json or "-"} (--json)
                      {result.fleet_report or "-"} (--all: every run of the storage)
                      made by: {result.report_command or "-"}
  logs                {result.logs_dir} (ckpt-operator.log, kube-apiserver.log, ...)
                      {result.pods_dir} (each training pod's output)
""".rstrip()


def _collect_logs(pods: Path, run_id: str, output: Path) -> list[Path]:
    """Every training pod's logs (decision logs, the persister's ``sidecar.jsonl``), copied
    as one would ``kubectl cp`` a pod's work dir before the pod goes: to
    ``<output>/logs/<pod>/<run_id>/``. Returns the ``<output>/logs/<pod>`` folders."""
    works = sorted({p.parent for glob in (LOG_GLOB, SIDECAR_GLOB) for p in pods.rglob(glob)})
    folders: list[Path] = []
    for work in works:
        folder = output / "logs" / work.relative_to(pods).parts[0]
        while folder in folders:  # two work dirs in one pod: keep them apart
            folder = folder.with_name(folder.name + "+")
        (folder / run_id).mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.jsonl"):
            shutil.copy2(log, folder / run_id / log.name)
        folders.append(folder)
    return folders


def _ckpt_report(*args: str) -> None:
    """``ckpt report ARGS``, the real command line (in this process)."""
    try:
        ckpt_main(["report", *args])
    except SystemExit as e:
        if e.code:
            raise ClusterError(f"ckpt report {' '.join(args)} failed (exit {e.code})") from None


def _checkpointing_reports(result: DemoResult, store: Path, pods: Path, output: Path) -> None:
    """``ckpt report`` of the demo's run (HTML and ``--json``; storage plus every training
    pod's logs, one ``--work-dir`` each) and ``ckpt report --all`` over its storage."""
    folders = _collect_logs(pods, result.run_id, output)
    run = ["--storage", str(store), "--run-id", result.run_id]
    for folder in folders:
        run += ["--work-dir", str(folder / result.run_id)]
    fleet = ["--storage", str(store), "--all"]
    for folder in folders:
        fleet += ["--work-dir", str(folder)]
    html, doc = output / "checkpointing.html", output / "checkpointing.json"
    _ckpt_report(*run, "--out", str(html))
    _ckpt_report(*run, "--json", "--out", str(doc))
    fleet_html = output / "checkpointing-all.html"
    _ckpt_report(*fleet, "--out", str(fleet_html))
    _ckpt_report(*fleet, "--json", "--out", str(fleet_html.with_suffix(".json")))
    result.checkpointing_report, result.checkpointing_json = str(html), str(doc)
    result.fleet_report = str(fleet_html)
    result.report_command = "ckpt report " + " ".join(run)


def _write_report(result: DemoResult, output: Path, stack: Stack) -> None:
    (output / "report.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    events_md = "\n".join(f"    {line}" for line in result.events)
    (output / "report.md").write_text(
        f"""# ckpt-operator demo report

Operator: chart `{stack.install.release}` in namespace `{stack.install.namespace}`, running as
ServiceAccount `{stack.install.sa_user}`.
{summary_text(result)}

## Events in namespace {result.namespace}

{events_md}
"""
    )


# --------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ckpt_e2e.demo",
        description="Local control plane + helm install + a training job that is killed "
        "and resumes automatically. Output under demo-output/.",
    )
    p.add_argument("--keep", action="store_true", help="leave the cluster and operator running")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="output root folder")
    p.add_argument("--steps", type=int, default=DEMO_TRAINING.steps, help="training steps")
    args = p.parse_args(argv)
    say = Printer()
    out = args.output.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        latest = args.output.resolve() / "latest"
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(out.name)
    training = dataclasses.replace(DEMO_TRAINING, steps=args.steps)

    say("ckpt-operator demo", style="title")
    say(
        "starting the local control plane (etcd, kube-apiserver, controller-manager, "
        "scheduler, kwok, training-operator) ..."
    )
    cluster = LocalCluster(out / "cluster", persistent=args.keep, startup_timeout=180)
    stack: Stack | None = None
    ok = False
    try:
        cluster.start()
        say(f"  control plane up in {cluster.timings['total']:.1f}s: {cluster.server}")
        say("helm install ckpt charts/ckpt-operator -n ckpt-system ...", style="title")
        stack = Stack.up(cluster)
        say(
            f"  chart installed (CRD, RBAC, webhooks, Deployment); operator running as "
            f"{stack.install.sa_user}"
        )
        result = run_demo(cluster, stack, out, training=training, say=say)
        print(summary_text(result), flush=True)
        ok = result.exact
    except (ClusterError, TimeoutError, AssertionError) as e:
        cluster.mark_failed()
        say(f"demo failed: {e}", style="bad")
        say(f"logs: {cluster.log_dir}")
    finally:
        if args.keep and cluster.procs:
            if stack is not None:
                stack.operator.release()
            cluster.release()
            print(
                f"\nLeft running (--keep):\n  export KUBECONFIG={cluster.kubeconfig}\n"
                f"  export PATH={cluster.bin['kubectl'].parent}:$PATH\n"
                f"  kubectl get pytorchjobs,checkpointpolicies -n {DEMO_NAMESPACE}\n"
                "  (the demo's pod runner is gone: pods created from now on stay Running on\n"
                "  kwok without a process)\n"
                f"  stop it: PYTHONPATH={REPO_ROOT / 'e2e'} {sys.executable} -m ckpt_e2e down "
                f"{cluster.workdir} --keep",
                flush=True,
            )
        else:
            say("tearing down ...")
            if stack is not None:
                stack.down()
            cluster.stop()
            shutil.rmtree(cluster.workdir / "etcd-data", ignore_errors=True)
            say("done", style="ok" if ok else "bad")
    return 0 if ok else 1


if __name__ == "__main__":
    # SIGTERM/SIGHUP end the demo through the harness's cleanup (atexit, finally blocks).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
