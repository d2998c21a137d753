"""The operator at fleet scale (issue #19), on the local real control plane.

What runs: ``ckpt_e2e``'s LocalCluster (kube-apiserver, etcd, kwok nodes, the Kubeflow
training-operator) with the chart installed and the operator running as its Deployment
would (``ckpt_e2e.stack``). N opted-in PyTorchJobs are submitted; nothing trains (their
pods are failed through their status, as a container exit would be reported; with
``--storage s3`` each run gets real checkpoints on a MinIO first), so what is measured
is the operator and the control plane around it:

* **trickle**: N/2 jobs failed one at a time (``--gap`` seconds apart);
* **burst**: the other N/2 failed at once;

and for each: restart latency (failure reported → the restart job's creation, seen
through a watch) p50/p95/p99/max, then for the whole run: every process's CPU per
restart during the burst (what bounds the drain), the pod webhook's admission latency
p99 (the API server's own
``apiserver_admission_webhook_admission_duration_seconds``, network included), API
requests per restart (the operator's: the API server's priority-and-fairness dispatch
count of its ServiceAccount's flow schema; every client's: ``apiserver_request_total``),
the operator's CPU seconds, peak RSS and RSS after each round's deletion (``--rounds``).

Run (a few minutes at the default N)::

    .venv/bin/python benchmarks/bench_fleet.py --jobs 40 [--write-doc]

The Kueue priority boost at fleet scale (issue #30) is ``bench_fleet_kueue.py`` (it uses
this module's helpers).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from _common import write_marked

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e"))

from ckpt_agent.format.layout import validation_key  # noqa: E402
from ckpt_agent.format.manifest import CheckpointMeta  # noqa: E402
from ckpt_agent.format.verdict import ValidationVerdict  # noqa: E402
from ckpt_agent.persist.encoding import CodecPolicy  # noqa: E402
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource  # noqa: E402
from ckpt_agent.policy.models import Tier  # noqa: E402
from ckpt_agent.records import CheckpointStatus  # noqa: E402
from ckpt_agent.storage import Storage, open_storage  # noqa: E402
from ckpt_e2e import s3servers  # noqa: E402
from ckpt_e2e.cluster import LocalCluster  # noqa: E402
from ckpt_e2e.errors import ApiError  # noqa: E402
from ckpt_e2e.scenario import Scenario  # noqa: E402
from ckpt_e2e.stack import Stack  # noqa: E402
from ckpt_e2e.training import Training, annotations_of, list_jobs, s3_storage  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
#: ``--profile``: this folder's ``sitecustomize`` profiles the operator (see its docstring)
PROFILER = Path(__file__).resolve().parent / "fleetprof"
MARKER = "<!-- bench_fleet -->"
JOB_LABEL = "training.kubeflow.org/job-name"
#: The API server's priority-and-fairness flow schema of ServiceAccounts outside
#: kube-system: the operator's (the training-operator, kwok and this script use admin
#: credentials, exempt).
OPERATOR_FLOW = "service-accounts"

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``name``'s samples in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] == name:
            out.append((dict(_LABEL.findall(m["labels"])), float(m["value"])))
    return out


def request_counts(cluster: LocalCluster) -> Counter[tuple[str, str]]:
    """``apiserver_request_total`` by (verb, resource), plus ``("operator", "")``: the
    requests the API server dispatched for the operator's flow schema."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    totals: Counter[tuple[str, str]] = Counter()
    for labels, value in samples(text, "apiserver_request_total"):
        totals[(labels.get("verb", ""), labels.get("resource", ""))] += int(value)
    for labels, value in samples(text, "apiserver_flowcontrol_dispatched_requests_total"):
        if labels.get("flow_schema") == OPERATOR_FLOW:
            totals[("operator", "")] += int(value)
    return totals


def event_counts(cluster: LocalCluster, namespace: str) -> Counter[str]:
    """The namespace's Events by ``<reporting component>/<reason>`` (their ``count``)."""
    items = cluster.request("GET", f"/api/v1/namespaces/{namespace}/events").get("items") or []
    counts: Counter[str] = Counter()
    for e in items:
        who = e.get("reportingComponent") or (e.get("source") or {}).get("component") or "?"
        counts[f"{who}/{e.get('reason')}"] += int(e.get("count") or 1)
    return counts


def webhook_calls(cluster: LocalCluster) -> Counter[str]:
    """The API server's admission webhook calls so far, by webhook name."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    calls: Counter[str] = Counter()
    for labels, value in samples(
        text, "apiserver_admission_webhook_admission_duration_seconds_count"
    ):
        calls[labels.get("name", "")] += int(value)
    return calls


def webhook_p99(cluster: LocalCluster, webhook: str) -> tuple[float, int]:
    """p99 (upper bucket bound, seconds) and count of the API server's admission calls."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    buckets: dict[float, float] = {}
    for labels, value in samples(
        text, "apiserver_admission_webhook_admission_duration_seconds_bucket"
    ):
        if labels.get("name") == webhook:
            le = math.inf if labels["le"] == "+Inf" else float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    if not buckets:
        return math.nan, 0
    total = buckets[math.inf]
    for le in sorted(buckets):
        if buckets[le] >= 0.99 * total:
            return le, int(total)
    return math.inf, int(total)


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class ProcessTree:
    """CPU seconds and peak RSS of a process and its children (sampled)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.cpu0 = self._cpu()
        self.peak_rss = 0

    def procs(self) -> list[psutil.Process]:
        return [self.root, *self.root.children(recursive=True)]

    def _cpu(self) -> float:
        total = 0.0
        for p in self.procs():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def rss(self) -> int:
        total = 0
        for p in self.procs():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self.rss())

    def cpu(self) -> float:
        return self._cpu() - self.cpu0


def cpu_by_process(operator: ProcessTree) -> Counter[str]:
    """CPU seconds of every process on the machine, by name (the operator's process tree
    as ``ckpt-operator``), plus ``machine``: the busy time of every CPU (``/proc/stat``)."""
    out: Counter[str] = Counter()
    ours = {p.pid for p in operator.procs()}
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info["cpu_times"]
        if t is None:
            continue
        if p.pid in ours:
            name = "ckpt-operator"
        elif p.pid == os.getpid():
            name = "this benchmark"
        else:
            name = p.info["name"] or "?"
        out[name] += t.user + t.system
    busy = psutil.cpu_times()
    out["machine"] = sum(busy) - busy.idle - getattr(busy, "iowait", 0.0)
    return out


def cpu_shares(before: Counter[str], after: Counter[str], n: int) -> str:
    """Milliseconds of CPU per restart, the machine's and its largest consumers'."""
    delta = Counter({k: after[k] - before.get(k, 0.0) for k in after})
    machine = delta.pop("machine")
    top = [(k, v) for k, v in delta.most_common(6) if v > 0]
    parts = ", ".join(f"{k} {v / n * 1000:.0f}" for k, v in top)
    bound = psutil.cpu_count() / (machine / n) if machine > 0 else math.nan
    return (
        f"machine {machine / n * 1000:.0f} ms ({parts}); {psutil.cpu_count()} CPUs at this "
        f"cost drain at most {bound:.0f} restarts/s"
    )


def job_pod(sc: Scenario, job: str) -> str | None:
    path = f"/api/v1/namespaces/{sc.namespace}/pods?labelSelector={JOB_LABEL}%3D{job}"
    for pod in sc.cluster.request("GET", path).get("items") or []:
        return str(pod["metadata"]["name"])
    return None


class RestartWatch:
    """When each restart job (``<job>-r1``) was created, as a watch of the namespace's
    PyTorchJobs reports it: no polling LIST of every job (at 0.2 s, with hundreds of
    jobs, a load on the API server the operator would share)."""

    def __init__(self, sc: Scenario) -> None:
        self.created: dict[str, float] = {}
        self.stopped = threading.Event()
        self._sc = sc
        self._thread = threading.Thread(target=self._run, daemon=True, name="restart-watch")
        self._thread.start()

    def _run(self) -> None:
        path = f"/apis/kubeflow.org/v1/namespaces/{self._sc.namespace}/pytorchjobs"
        while not self.stopped.is_set():  # a stream the server ends is opened again
            try:
                listed = self._sc.cluster.request("GET", path)
                for job in listed.get("items") or []:
                    self._seen(job)
                version = (listed.get("metadata") or {}).get("resourceVersion")
                for event in self._sc.cluster.watch(f"{path}?resourceVersion={version}"):
                    if event.get("type") == "ADDED":
                        self._seen(event.get("object") or {})
            except (OSError, ApiError, ValueError):  # the cluster going away at the end
                self.stopped.wait(1.0)

    def _seen(self, job: dict[str, Any]) -> None:
        name = str((job.get("metadata") or {}).get("name", ""))
        if name.endswith("-r1"):
            self.created.setdefault(name.removesuffix("-r1"), time.monotonic())


def wait_restarts(
    watch: RestartWatch,
    failed_at: dict[str, float],
    expected: int,
    tree: ProcessTree,
    timeout: float,
    log_dir: Path,
) -> dict[str, float]:
    """Seconds from each job's failure to its restart's creation (as the watch saw it),
    while ``failed_at`` fills up, until ``expected`` restarts were seen."""
    latency: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(latency) < expected and time.monotonic() < deadline:
        if not tree.root.is_running() or tree.root.status() == psutil.STATUS_ZOMBIE:
            raise SystemExit(f"the operator exited; see {log_dir}/ckpt-operator.log")
        for job, t0 in list(failed_at.items()):
            if job not in latency and job in watch.created:
                latency[job] = max(0.0, watch.created[job] - t0)
        tree.sample()
        time.sleep(0.05)
    if len(latency) < expected:
        missing = sorted(set(failed_at) - set(latency))[:5]
        raise SystemExit(
            f"{expected - len(latency)} restarts missing after {timeout:.0f}s: {missing}"
        )
    return latency


def fail(sc: Scenario, jobs: Sequence[str], pods: dict[str, str]) -> dict[str, float]:
    """Report every job's pod as exited 137 at once (threads); returns when each was sent."""
    stamps: dict[str, float] = {}

    def one(job: str) -> None:
        stamps[job] = time.monotonic()
        sc.cluster.set_pod_exit(sc.namespace, pods[job], 137)

    with ThreadPoolExecutor(min(32, len(jobs))) as pool:
        list(pool.map(one, jobs))
    return stamps


def summary(name: str, lat: dict[str, float]) -> tuple[str, str]:
    xs = list(lat.values())
    return name, (
        f"p50 {percentile(xs, 50):.2f} s, p95 {percentile(xs, 95):.2f} s, "
        f"p99 {percentile(xs, 99):.2f} s, max {max(xs):.2f} s (n={len(xs)})"
    )


def settled_rss(tree: ProcessTree, seconds: float = 10.0) -> int:
    """The operator's RSS once it stopped moving (the lowest of a few samples)."""
    low = tree.rss()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(1.0)
        low = min(low, tree.rss())
    return low


def delete_all(sc: Scenario, names: Sequence[str], timeout: float) -> None:
    """Delete every job (and restart) of the run; wait until their pods are gone."""
    # DELETEs of the collection (``kubectl delete --all`` sends one per job: minutes); the
    # API server may give up on one (504 after its 60 s) having deleted part of it
    path = f"/apis/kubeflow.org/v1/namespaces/{sc.namespace}/pytorchjobs"
    deadline = time.monotonic() + timeout
    while list_jobs(sc.cluster, sc.namespace) and time.monotonic() < deadline:
        try:
            sc.cluster.request("DELETE", path, timeout=timeout)
        except ApiError as e:
            if e.status != 504:
                raise

    def gone() -> bool:
        path = f"/api/v1/namespaces/{sc.namespace}/pods?labelSelector={JOB_LABEL}"
        left = sc.cluster.request("GET", path).get("items") or []
        return not left and not list_jobs(sc.cluster, sc.namespace)

    sc.cluster.wait_for(gone, timeout, f"{len(names)} jobs and their pods deleted")


def profile_operator(
    out: Path, *, tracemalloc: bool = False, cprofile: bool = False, frames: int = 1
) -> None:
    """Make the operator started from now on profile itself into ``out`` (``fleetprof``)."""
    os.environ["FLEETPROF_MODE"] = "cprofile" if cprofile else "sample"
    os.environ["CKPT_E2E_OPERATOR"] = "process"  # this virtualenv's code, profiled
    os.environ["FLEETPROF_DIR"] = str(out)
    os.environ["FLEETPROF_TRACEMALLOC"] = "1" if tracemalloc else "0"
    os.environ["FLEETPROF_FRAMES"] = str(frames)
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(PROFILER) + (os.pathsep + path if path else "")


def signal_operator(pid: int, sig: signal.Signals, profiling: bool) -> None:
    """``SIGUSR1``: heap dump; ``SIGUSR2``: CPU samples since the last one (when profiling).
    Returns once the dump is written (a heap dump of a large heap takes a while)."""
    if not profiling:
        return
    out = Path(os.environ["FLEETPROF_DIR"])
    before = len(list(out.glob("heap-*.txt")))
    os.kill(pid, sig)
    deadline = time.monotonic() + (120 if sig == signal.SIGUSR1 else 0)
    while len(list(out.glob("heap-*.txt"))) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2.0)


#: the checkpoints written for every run in ``--storage s3`` (tier, step): the restart
#: must resume from the newest, the pulse
CHECKPOINTS = ((Tier.FULL, 100), (Tier.PULSE, 200))
RESUME_FROM = "ckpt.dev/resume-from"


def write_checkpoints(
    storage: Storage,
    run_id: str,
    checkpoints: Sequence[tuple[Tier, int]] = CHECKPOINTS,
    created_at: float | None = None,
) -> str:
    """Real checkpoints of ``run_id`` in ``storage`` (each a few KiB, SHA-256 and a VALID
    validation record as the agent and validator write them), chained in the order given;
    returns the newest's id. ``created_at``: their creation time (default: now)."""
    writer = CheckpointWriter(storage, run_id, codec=CodecPolicy(codec="none"), inline_max_bytes=0)
    prev: str | None = None
    newest = ""
    for tier, step in checkpoints:
        meta = CheckpointMeta(
            run_id=run_id,
            step=step,
            tier=tier,
            created_at=time.time() if created_at is None else created_at,
            prev_hash=prev,
        )
        weights = os.urandom(16 * 1024)
        tensors = [TensorSource("weights", "uint8", (len(weights),), memoryview(weights))]
        rank = writer.write_rank(meta, 0, {"step": step}, tensors)
        done = writer.commit(meta, [rank])
        record = ValidationVerdict(meta.checkpoint_id, done.manifest_hash, CheckpointStatus.VALID)
        storage.commit(validation_key(run_id, meta.checkpoint_id), record.to_bytes())
        prev, newest = done.manifest_hash, meta.checkpoint_id
    return newest


@dataclass
class S3Checkpoints:
    """``--storage s3``: a real MinIO holds the policy's storage, and every job's run gets
    real checkpoints (a full one and a newer pulse, each a few KiB, SHA-256 and validation
    records as the agent writes them) before it fails, so the operator's restart lists the
    run on S3, reads its records and verifies the one it resumes from."""

    server: s3servers.MinioServer
    bucket: str
    storage: Storage

    @classmethod
    def start(
        cls, sc: Scenario, workdir: Path, extra_env: dict[str, str] | None = None
    ) -> S3Checkpoints:
        server = s3servers.start_minio(s3servers.build_tool("minio"), workdir, extra_env=extra_env)
        bucket = f"bench-fleet-{uuid.uuid4().hex[:8]}"
        server.client().create_bucket(Bucket=bucket)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-creds"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": server.access_key,
                "AWS_SECRET_ACCESS_KEY": server.secret_key,
            },
        }
        sc.cluster.apply(secret, namespace=sc.namespace)
        storage = open_storage(f"s3://{bucket}/fleet", server.storage_options())
        return cls(server, bucket, storage)

    def policy_storage(self) -> dict[str, Any]:
        return s3_storage(self.bucket, self.server.endpoint, "s3-creds", prefix="fleet")

    def write(self, run_id: str) -> str:
        """The run's checkpoints; returns the id a restart must resume from."""
        return write_checkpoints(self.storage, run_id)

    def stop(self) -> None:
        self.storage.close()
        self.server.stop()


@dataclass
class Cycle:
    """One round of the run: N jobs submitted, failed (trickle, then burst), restarted
    and deleted, and what was measured along the way."""

    lat_trickle: dict[str, float]
    lat_burst: dict[str, float]
    burst_cpu: str
    delta: Counter[tuple[str, str]]
    hooks: Counter[str]
    events: Counter[str]
    cpu: float
    rss_after: int
    resumed: str = ""
    """``--storage s3``: how many restarts resume from the run's newest checkpoint."""


def cycle(
    sc: Scenario,
    tree: ProcessTree,
    names: Sequence[str],
    trickle_n: int,
    gap: float,
    timeout: float,
    log: Callable[[str], None],
    profiling: bool,
    s3: S3Checkpoints | None = None,
) -> Cycle:
    cluster, pid = sc.cluster, tree.root.pid
    with ThreadPoolExecutor(8) as submitter:
        list(submitter.map(lambda name: sc.submit(name, Training(steps=5)), names))
    pods: dict[str, str] = {}
    for name in names:
        pods[name] = str(cluster.wait_for(functools.partial(job_pod, sc, name), 120))
    log(f"{len(names)} jobs running (one pod each, injected)")
    newest: dict[str, str] = {}
    if s3 is not None:
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as writers:
            ids = list(writers.map(lambda name: s3.write(sc.run_id(name)), names))
        newest = dict(zip(names, ids, strict=True))
        log(f"{len(names)} runs given checkpoints on S3 in {time.monotonic() - t0:.0f} s")
    before = request_counts(cluster)
    hooks_before = webhook_calls(cluster)
    events_before = event_counts(cluster, sc.namespace)
    signal_operator(pid, signal.SIGUSR2, profiling)  # stacks: start and submission
    cpu0 = tree.cpu()

    trickle, burst = names[:trickle_n], names[trickle_n:]
    watch = RestartWatch(sc)
    logs = cluster.log_dir
    with ThreadPoolExecutor(1) as poller:
        failed: dict[str, float] = {}
        waiting = poller.submit(wait_restarts, watch, failed, len(trickle), tree, timeout, logs)
        for job in trickle:
            failed.update(fail(sc, [job], pods))
            time.sleep(gap)
        lat_trickle = waiting.result()
    log("trickle done")
    burst_cpu0 = cpu_by_process(tree)
    failed = fail(sc, burst, pods)
    lat_burst = wait_restarts(watch, failed, len(burst), tree, timeout, logs)
    burst_cpu = cpu_shares(burst_cpu0, cpu_by_process(tree), len(burst))
    log("burst done")
    # the restarts' pods are admitted too; let them all be created
    for job in names:
        cluster.wait_for(functools.partial(job_pod, sc, f"{job}-r1"), 120, f"{job}-r1 pod")
    tree.sample()
    delta = request_counts(cluster) - before
    hooks = webhook_calls(cluster) - hooks_before
    events = event_counts(cluster, sc.namespace) - events_before
    cpu = tree.cpu() - cpu0
    resumed = ""
    if s3 is not None:
        jobs = {str(j["metadata"]["name"]): j for j in list_jobs(cluster, sc.namespace)}
        right = sum(
            annotations_of(jobs.get(f"{job}-r1")).get(RESUME_FROM) == newest[job] for job in names
        )
        resumed = f"{right} of {len(names)}"
        log(f"restarts resuming from their run's newest checkpoint: {resumed}")
    log(f"{summary('trickle', lat_trickle)}; {summary('burst', lat_burst)}")
    log(f"operator CPU {cpu:.1f} s, peak RSS {tree.peak_rss / 2**20:.0f} MiB")
    signal_operator(pid, signal.SIGUSR2, profiling)  # stacks: the failures
    signal_operator(pid, signal.SIGUSR1, profiling)  # heap: every job and restart live
    delete_all(sc, names, timeout)
    watch.stopped.set()
    after = settled_rss(tree, 20.0)
    signal_operator(pid, signal.SIGUSR1, profiling)  # heap: after the deletion
    log(f"jobs deleted; operator RSS {after / 2**20:.0f} MiB")
    return Cycle(lat_trickle, lat_burst, burst_cpu, delta, hooks, events, cpu, after, resumed)


def run(
    trickle_n: int,
    burst_n: int,
    gap: float,
    timeout: float,
    log: Callable[[str], None],
    profiling: bool = False,
    cycles: int = 1,
    storage: str = "local",
) -> list[tuple[str, str]]:
    n = trickle_n + burst_n
    cluster = LocalCluster(startup_timeout=300)
    cluster.start()
    s3: S3Checkpoints | None = None
    try:
        stack = Stack.up(cluster)
        ns = cluster.create_namespace(f"bench-fleet-{uuid.uuid4().hex[:5]}")
        sc = Scenario(cluster, ns, stack.operator)
        # retention (a pass over every run of the policy) only before the failures: the
        # measured CPU is the restarts' (at the e2e's 10 s a pass per 10 s of the run)
        if storage == "s3":
            s3 = S3Checkpoints.start(sc, cluster.log_dir / "minio")
        sc.apply_policy(
            "e2e",
            s3.policy_storage() if s3 is not None else None,
            recovery={"backoffSeconds": 0},
            retention={"reconcileIntervalSeconds": 3600},
        )
        sc.runner(decide=lambda pod: "ignore")
        tree = ProcessTree(stack.operator.pid)
        baseline = settled_rss(tree)
        signal_operator(stack.operator.pid, signal.SIGUSR1, profiling)  # heap-1: baseline
        rounds: list[Cycle] = []
        for k in range(cycles):
            prefix = "job" if k == 0 else f"job{k}"
            names = [f"{prefix}-{i:03d}" for i in range(n)]
            rounds.append(cycle(sc, tree, names, trickle_n, gap, timeout, log, profiling, s3))
        last = rounds[-1]
        p99, calls = webhook_p99(cluster, "inject.pods.ckpt.dev")
        delta = last.delta
        ours = delta.pop(("operator", ""), 0)
        total = sum(delta.values())
        writes = ", ".join(
            f"{verb} {res} {delta[(verb, res)] / n:.1f}"
            for verb, res in (("PATCH", "pytorchjobs"), ("POST", "pytorchjobs"), ("POST", "events"))
        )
        burst = last.lat_burst
        drain = len(burst) / max(burst.values()) if burst else math.nan
        rss = [baseline, *(r.rss_after for r in rounds)]
        rss_row = (
            " → ".join(f"{x / 2**20:.0f}" for x in rss)
            + " MiB ("
            + ", ".join(f"{(x - baseline) / baseline * 100:+.0f} %" for x in rss[1:])
        )
        if len(rss) > 2:  # every round after the first, against the first's
            rss_row += (
                "; "
                + ", ".join(f"{(x - rss[1]) / rss[1] * 100:+.0f} %" for x in rss[2:])
                + " over the first round's"
            )
        rss_row += ")"
        which = f" (round {cycles} of {cycles})" if cycles > 1 else ""
        return [
            summary(f"restart latency, trickle{which}", last.lat_trickle),
            summary(f"restart latency, burst{which}", burst),
            ("burst drain rate", f"{drain:.1f} restarts/s ({len(burst)} failed at once)"),
            ("CPU per restart during the burst, by process", last.burst_cpu),
            ("pod admission latency p99 (API server)", f"<= {p99:g} s over {calls} calls"),
            ("API requests per restart, the operator's", f"{ours / n:.1f}"),
            (
                "admission calls per restart (API server)",
                ", ".join(f"{name} {k / n:.1f}" for name, k in sorted(last.hooks.items()))
                or "none",
            ),
            ("writes per restart (all clients)", writes),
            (
                "Events per restart, by reporter/reason",
                ", ".join(f"{k} {v / n:.1f}" for k, v in last.events.most_common(12)),
            ),
            ("API requests per restart, every client", f"{total / n:.1f}"),
            (
                "operator CPU",
                f"{last.cpu:.1f} s for {n} restarts ({last.cpu / n * 1000:.0f} ms each)",
            ),
            ("operator peak RSS", f"{tree.peak_rss / 2**20:.0f} MiB"),
            ("operator RSS: baseline → after each round's jobs are deleted", rss_row),
            *(
                [("restarts resuming from their run's newest checkpoint (S3)", last.resumed)]
                if s3 is not None
                else []
            ),
        ]
    finally:
        if s3 is not None:
            s3.stop()
        cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=40, help="jobs (half trickle, half burst)")
    p.add_argument("--trickle", type=int, help="jobs failed one at a time (default: half)")
    p.add_argument("--burst", type=int, help="jobs failed at once (default: the rest)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole run (submit, fail, restart, delete) this many times in one "
        "operator; the tables are the last round's, the RSS row has every round's",
    )
    p.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="the policy's storage: local (a folder; runs without checkpoints, every "
        "restart fresh) or s3 (a real MinIO; every run gets checkpoints before it fails, "
        "so restarts list, read and verify them on S3)",
    )
    p.add_argument("--gap", type=float, default=0.25, help="seconds between trickle failures")
    p.add_argument("--timeout", type=float, default=300.0, help="longest wait for restarts")
    p.add_argument("--write-doc", action="store_true", help=f"write the table into {DOC}")
    p.add_argument("--profile", type=Path, help="profile the operator into this folder")
    p.add_argument("--tracemalloc", action="store_true", help="with --profile: trace allocations")
    p.add_argument(
        "--frames",
        type=int,
        default=1,
        help="with --tracemalloc: frames per allocation site (later heap dumps list the "
        "sites of what lives beyond the first dump)",
    )
    p.add_argument(
        "--cprofile", action="store_true", help="with --profile: cProfile (CPU time) every thread"
    )
    args = p.parse_args(argv)
    if args.profile is not None:
        profile_operator(
            args.profile.resolve(),
            tracemalloc=args.tracemalloc,
            cprofile=args.cprofile,
            frames=args.frames,
        )
    trickle = args.jobs // 2 if args.trickle is None else args.trickle
    burst = args.jobs - trickle if args.burst is None else args.burst
    if trickle < 1 or burst < 1:
        raise SystemExit("at least one job failed each way (--jobs >= 2, --trickle/--burst >= 1)")
    rows = run(
        trickle,
        burst,
        args.gap,
        args.timeout,
        lambda s: print(s, flush=True),
        profiling=args.profile is not None,
        cycles=args.rounds,
        storage=args.storage,
    )
    lines = [
        f"`benchmarks/bench_fleet.py --trickle {trickle} --burst {burst}"
        f"{' --storage s3' if args.storage == 's3' else ''}"
        f"{f' --rounds {args.rounds}' if args.rounds > 1 else ''}` "
        f"({psutil.cpu_count()} CPUs, "
        "local control plane, operator and control plane on the same machine):",
        "",
        "| measure | value |",
        "|---|---|",
        *[f"| {a} | {b} |" for a, b in rows],
    ]
    print("\n".join(lines))
    if args.write_doc:
        write_marked(DOC, MARKER, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
