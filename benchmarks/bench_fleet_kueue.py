"""The operator's Kueue priority-boost writes at fleet scale (issue #30).

What runs: ``bench_fleet``'s control plane (``ckpt_e2e``'s LocalCluster: kube-apiserver,
etcd, kwok nodes, the Kubeflow training-operator; the chart installed and the operator
running as its Deployment would), plus the real Kueue controller manager
(``ckpt_e2e.kueue``, ``PriorityBoost`` on) and the chart's ``kueue.enabled`` (the
operator's ``--kueue``). N opted-in PyTorchJobs labelled for one LocalQueue whose
ClusterQueue has quota for all of them: Kueue admits every one, the training-operator
creates their pods, the webhook injects them; nothing trains (kwok pods). The run then
goes on for ``--duration`` seconds while the operator keeps each Workload's
``kueue.x-k8s.io/priority-boost`` in step with its job's at-risk work.

Jobs alternate between two policies with the boost on (:data:`SETTINGS`: the defaults,
``secondsPerPoint: 30, minUpdateSeconds: 30``, and a fast one, ``secondsPerPoint: 1,
minUpdateSeconds: 5``, where a few minutes show the rate limit bind), and, within each,
between three kinds of runs (:data:`GROUPS`), so that at-risk work is not only "time since
admission":

* ``none``: no checkpoint (at-risk = since admission + the 60 s save assumed without one);
* ``once``: real checkpoints (a full one and a pulse, valid, in the policy's storage)
  written once at the start;
* ``every``: a new valid full checkpoint every ``--recheckpoint`` seconds: the at-risk
  work drops back each time, so the boost moves down and up again all along.

Measured: every write of the boost, as a watch of the namespace's Workloads sees the
operator's record (``ckpt.dev/priority-boost-written``/``-written-at``) change: per job the
writes (mean, max), the bound the rate limit implies (``floor(elapsed /
minUpdateSeconds) + 1`` from the job's first write to the end) and the shortest gap between
two writes of one Workload (``written-at`` has whole seconds); the API server's requests
on Workloads, Events and PyTorchJobs (``apiserver_request_total`` by verb and subresource,
every client: the operator's PATCHes and Kueue's own), the namespace's Events by reason,
the operator's requests (its flow schema) and its metric
``ckpt_priority_boost_writes_total``; the operator's CPU seconds and peak RSS over the
window, and the machine's load average. With ``--storage s3`` the policies' storage is a
real MinIO (``bench_fleet.S3Checkpoints``) and its request counts by API (minus this
benchmark's own new checkpoints) say what the operator's looks cost an object store.

Run (about 5 minutes of setup plus ``--duration``)::

    nice -n 19 ionice -c3 .venv/bin/python benchmarks/bench_fleet_kueue.py --jobs 100
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
from bench_fleet import (
    OPERATOR_FLOW,
    ProcessTree,
    S3Checkpoints,
    event_counts,
    job_pod,
    percentile,
    samples,
    settled_rss,
    write_checkpoints,
)

from ckpt_agent.policy.models import Tier
from ckpt_agent.storage import open_storage
from ckpt_e2e.cluster import LocalCluster
from ckpt_e2e.errors import ApiError
from ckpt_e2e.kueue import (
    PRIORITY_BOOST_ANNOTATION,
    WORKLOADS,
    Kueue,
    cluster_queue,
    local_queue,
    queue_labels,
    resource_flavor,
    with_labels,
    workload_condition,
)
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.stack import Stack
from ckpt_e2e.training import Training, pytorchjob_manifest

#: The operator's record of its own boost writes, on the Workload (docs/kueue.md).
WRITTEN = "ckpt.dev/priority-boost-written"
WRITTEN_AT = "ckpt.dev/priority-boost-written-at"
#: The policies' boost settings (``maxBoost`` left at its default, 100).
SETTINGS: dict[str, dict[str, float]] = {
    "default": {"secondsPerPoint": 30, "minUpdateSeconds": 30},
    "fast": {"secondsPerPoint": 1, "minUpdateSeconds": 5},
}
GROUPS = ("none", "once", "every")
BOOST_WRITES = "ckpt_priority_boost_writes_total"
#: ``--storage s3``: MinIO's request counts readable without a token.
MINIO_ENV = {"MINIO_PROMETHEUS_AUTH_TYPE": "public"}


@dataclass
class Boosts:
    """Per Workload (by its job's name): the boost writes seen, each as the operator's
    ``written-at`` (its clock), and removals."""

    writes: dict[str, list[float]] = field(default_factory=dict)
    removals: Counter[str] = field(default_factory=Counter)
    last: dict[str, tuple[str | None, str | None, str | None]] = field(default_factory=dict)
    values: dict[str, str | None] = field(default_factory=dict)

    def seen(self, workload: Mapping[str, Any]) -> None:
        meta = workload.get("metadata") or {}
        owners = [r.get("name") for r in meta.get("ownerReferences") or ()]
        if not owners:
            return
        job = str(owners[0])
        ann = meta.get("annotations") or {}
        now = (ann.get(PRIORITY_BOOST_ANNOTATION), ann.get(WRITTEN), ann.get(WRITTEN_AT))
        before = self.last.get(job, (None, None, None))
        if now == before:
            return
        self.last[job] = now
        self.values[job] = now[0]
        if now[2] is not None and now[2] != before[2]:
            self.writes.setdefault(job, []).append(float(now[2]))
        elif now[1] is None and before[1] is not None:
            self.removals[job] += 1


class WorkloadWatch:
    """A watch of the namespace's Workloads feeding :class:`Boosts` (a stream the server
    ends is listed and watched again: a change is counted once, by value)."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.boosts = Boosts()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self._cluster = cluster
        self._path = WORKLOADS.format(namespace=namespace)
        self._thread = threading.Thread(target=self._run, daemon=True, name="workload-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                listed = self._cluster.request("GET", self._path)
                for wl in listed.get("items") or []:
                    self._seen(wl)
                version = (listed.get("metadata") or {}).get("resourceVersion")
                for event in self._cluster.watch(f"{self._path}?resourceVersion={version}"):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._seen(event.get("object") or {})
            except (OSError, ApiError, ValueError):
                self.stopped.wait(1.0)

    def _seen(self, wl: Mapping[str, Any]) -> None:
        with self.lock:
            self.boosts.seen(wl)


#: The resources whose API requests are counted (``apiserver_request_total``).
COUNTED = ("workloads", "events", "pytorchjobs")


def api_requests(cluster: LocalCluster) -> Counter[str]:
    """``apiserver_request_total`` of :data:`COUNTED` by ``VERB resource[/subresource]``
    (every client), plus ``operator``: every request dispatched for the operator's flow
    schema."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    out: Counter[str] = Counter()
    for labels, value in samples(text, "apiserver_request_total"):
        resource = labels.get("resource", "")
        if resource in COUNTED:
            sub = labels.get("subresource", "")
            out[f"{labels.get('verb', '')} {resource}" + (f"/{sub}" if sub else "")] += int(value)
    for labels, value in samples(text, "apiserver_flowcontrol_dispatched_requests_total"):
        if labels.get("flow_schema") == OPERATOR_FLOW:
            out["operator"] += int(value)
    return out


def assign(n: int) -> list[tuple[str, str, str]]:
    """(job, setting, group) for N jobs: settings alternate, groups cycle within each."""
    out = []
    names = list(SETTINGS)
    for i in range(n):
        setting = names[i % len(names)]
        group = GROUPS[(i // len(names)) % len(GROUPS)]
        out.append((f"job-{i:03d}", setting, group))
    return out


def bound(first: float, end: float, min_update: float) -> int:
    """The most writes the rate limit allows from ``first`` (a write) to ``end``."""
    return math.floor(max(0.0, end - first) / min_update) + 1


def s3_requests(s3: S3Checkpoints | None) -> Counter[str]:
    """MinIO's S3 requests by API (``minio_api_requests_total``, metrics v3: live, where
    v2's are a snapshot; public: :data:`MINIO_ENV`)."""
    if s3 is None:
        return Counter()
    with urllib.request.urlopen(
        f"{s3.server.endpoint}/minio/metrics/v3/api/requests", timeout=10
    ) as r:
        text = r.read().decode()
    out: Counter[str] = Counter()
    for labels, value in samples(text, "minio_api_requests_total"):
        if labels.get("type") == "s3":
            out[labels.get("name", "?")] += int(value)
    return out


def run(
    n: int,
    duration: float,
    recheckpoint: float,
    log: Callable[[str], None],
    storage_kind: str = "local",
) -> list[tuple[str, str]]:
    cluster = LocalCluster(startup_timeout=300)
    cluster.start()
    s3: S3Checkpoints | None = None
    try:
        kueue = Kueue(cluster).start()
        log(f"Kueue started in {kueue.timings['total']:.0f} s")
        stack = Stack.up(cluster, values={"kueue": {"enabled": True}})
        assert "--kueue=true" in stack.operator.deployment_args()
        ns = cluster.create_namespace(f"bench-kueue-{uuid.uuid4().hex[:5]}")
        sc = Scenario(cluster, ns, stack.operator)
        if storage_kind == "s3":
            s3 = S3Checkpoints.start(sc, cluster.log_dir / "minio", extra_env=MINIO_ENV)
        for setting, boost in SETTINGS.items():
            sc.apply_policy(
                setting,
                s3.policy_storage() if s3 is not None else None,
                extra={"preemption": {"priorityBoost": {"enabled": True, **boost}}},
                retention={"reconcileIntervalSeconds": 3600},
            )
        cq = f"cq-{ns}"[:63]
        kueue.apply(resource_flavor())
        kueue.apply(cluster_queue(cq, {"cpu": str(n), "memory": f"{n}Gi"}))
        kueue.apply(local_queue("lq", cq), namespace=ns)
        tree = ProcessTree(stack.operator.pid)
        baseline = settled_rss(tree, 5.0)
        watch = WorkloadWatch(cluster, ns)
        jobs = assign(n)
        t_submit = time.monotonic()

        def submit(job: tuple[str, str, str]) -> None:
            name, setting, _ = job
            manifest = pytorchjob_manifest(name, Training(steps=5), sc.results, policy=setting)
            cluster.apply(with_labels(manifest, queue_labels("lq")), namespace=ns)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(submit, jobs))
        log(f"{n} jobs submitted in {time.monotonic() - t_submit:.0f} s")

        def all_admitted() -> bool:
            wls = kueue.workloads(ns)
            return len(wls) >= n and all(workload_condition(w, "Admitted") for w in wls)

        cluster.wait_for(all_admitted, 300, f"{n} Workloads admitted", interval=2.0)
        for name, _, _ in jobs:
            cluster.wait_for(functools.partial(job_pod, sc, name), 180, f"{name}'s pod")
        log(f"{n} Workloads admitted, pods created, {time.monotonic() - t_submit:.0f} s")

        storage = s3.storage if s3 is not None else open_storage(f"file://{sc.store}")
        run_ids = {name: sc.run_id(name) for name, _, _ in jobs}
        with_ckpt = [name for name, _, g in jobs if g != "none"]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda name: write_checkpoints(storage, run_ids[name]), with_ckpt))
        log(f"{len(with_ckpt)} runs given checkpoints")

        # the window: from here, --duration seconds
        before = api_requests(cluster)
        s3_before = s3_requests(s3)
        ours: Counter[str] = Counter()  # this benchmark's own S3 requests (new checkpoints)
        if s3 is not None:

            def count(event_name: str, **_: Any) -> None:
                ours[event_name.rsplit(".", 1)[-1]] += 1

            s3.storage.client.meta.events.register("before-call.s3", count)  # type: ignore[attr-defined]
        events_before = event_counts(cluster, ns)
        ops_before = {
            a: stack.operator.metric(BOOST_WRITES, {"action": a}) for a in ("write", "remove")
        }
        cpu0 = tree.cpu()
        tree.peak_rss = 0
        load: list[float] = []
        t0_wall, t0 = time.time(), time.monotonic()
        every = [name for name, _, g in jobs if g == "every"]
        step = 300
        next_ckpt = t0 + recheckpoint
        while time.monotonic() - t0 < duration:
            if not tree.root.is_running() or tree.root.status() == psutil.STATUS_ZOMBIE:
                raise SystemExit(f"the operator exited; see {cluster.log_dir}/ckpt-operator.log")
            tree.sample()
            if time.monotonic() >= next_ckpt:
                step += 100
                for name in every:
                    write_checkpoints(storage, run_ids[name], ((Tier.FULL, step),))
                next_ckpt += recheckpoint
            load.append(os.getloadavg()[0])
            time.sleep(1.0)
        t1_wall = time.time()
        cpu = tree.cpu() - cpu0
        delta = api_requests(cluster) - before
        s3_after = s3_requests(s3)
        s3_delta = s3_after - s3_before - ours
        events = event_counts(cluster, ns) - events_before
        ops = {
            a: stack.operator.metric(BOOST_WRITES, {"action": a}) - ops_before[a]
            for a in ("write", "remove")
        }
        time.sleep(3.0)  # the watch sees the window's last writes (counted by written-at)
        watch.stopped.set()
        with watch.lock:
            boosts = watch.boosts
            writes = {k: list(v) for k, v in boosts.writes.items()}
            values = dict(boosts.values)
            removals = Counter(boosts.removals)
        warnings = stack.operator.tail(200_000).count("WARNING")
        if s3 is None:
            storage.close()
        log(f"operator CPU {cpu:.1f} s, peak RSS {tree.peak_rss / 2**20:.0f} MiB")

        rows: list[tuple[str, str]] = []
        for setting, boost in SETTINGS.items():
            mu = boost["minUpdateSeconds"]
            for group in (*GROUPS, "all"):
                names = [j for j, s, g in jobs if s == setting and group in (g, "all")]
                counts = [len(writes.get(j, [])) for j in names]
                in_window = [sum(t0_wall <= t <= t1_wall for t in writes.get(j, [])) for j in names]
                bounds = [bound(writes[j][0], t1_wall, mu) for j in names if writes.get(j)]
                over = sum(
                    len(writes[j]) > bound(writes[j][0], t1_wall, mu)
                    for j in names
                    if writes.get(j)
                )
                gaps = [b - a for j in names for a, b in itertools.pairwise(writes.get(j, []))]
                final = [int(v) for j in names if (v := values.get(j)) is not None]
                rows.append(
                    (
                        f"{setting} ({boost['secondsPerPoint']:g} s/point, "
                        f"{mu:g} s min), {group} ({len(names)} jobs)",
                        f"writes per job mean {sum(counts) / max(1, len(counts)):.1f}, "
                        f"max {max(counts, default=0)} (in the {duration:.0f} s window: mean "
                        f"{sum(in_window) / max(1, len(in_window)):.1f}, max "
                        f"{max(in_window, default=0)}, bound {math.floor(duration / mu) + 1}); "
                        f"bound from each job's first write to the end max "
                        f"{max(bounds, default=0)}, jobs over it {over}; shortest gap "
                        f"{min(gaps, default=math.nan):.1f} s, p50 "
                        f"{percentile(gaps, 50):.1f} s; boost at the end "
                        f"{min(final, default=0)}..{max(final, default=0)}; removals "
                        f"{sum(removals[j] for j in names)}",
                    )
                )
        total_writes = sum(sum(t0_wall <= t <= t1_wall for t in v) for v in writes.values())
        rows += [
            (
                "boost writes in the window (watch; operator metric)",
                f"{total_writes} ({total_writes / n:.1f} per job); metric write "
                f"{ops['write']:.0f}, remove {ops['remove']:.0f}",
            ),
            (
                "API requests in the window (API server, every client)",
                ", ".join(f"{k} {v}" for k, v in sorted(delta.items()) if k != "operator"),
            ),
            (
                "Events in the window, by reporter/reason",
                ", ".join(f"{k} {v}" for k, v in events.most_common(8)) or "none",
            ),
            (
                "the operator's API requests in the window",
                f"{delta['operator']} ({delta['operator'] / duration:.1f}/s)",
            ),
            (
                "operator CPU in the window",
                f"{cpu:.1f} s over {duration:.0f} s ({cpu / duration * 100:.1f} % of a core; "
                f"{cpu / (duration / 10) * 1000:.0f} ms per 10 s refresh period)",
            ),
            (
                "operator RSS",
                f"baseline {baseline / 2**20:.0f} MiB, peak in the window "
                f"{tree.peak_rss / 2**20:.0f} MiB",
            ),
            *(
                [
                    (
                        "S3 requests in the window but this benchmark's new checkpoints "
                        "(MinIO, by API)",
                        f"{sum(s3_delta.values())} ({sum(s3_delta.values()) / duration:.1f}/s): "
                        + ", ".join(f"{k} {v}" for k, v in s3_delta.most_common())
                        + f" (MinIO's count {sum((s3_after - s3_before).values())}, this "
                        f"benchmark's {sum(ours.values())})",
                    )
                ]
                if s3 is not None
                else []
            ),
            ("operator log WARNING lines (whole run)", str(warnings)),
            (
                "load average (1 min) in the window",
                f"min {min(load, default=math.nan):.2f}, max {max(load, default=math.nan):.2f}",
            ),
        ]
        return rows
    finally:
        if s3 is not None:
            s3.stop()
        cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=100, help="opted-in PyTorchJobs, all admitted")
    p.add_argument("--duration", type=float, default=300.0, help="seconds measured")
    p.add_argument(
        "--recheckpoint",
        type=float,
        default=30.0,
        help="seconds between new checkpoints of the 'every' runs",
    )
    p.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="the policies' storage: local (a folder) or s3 (a real MinIO; the S3 requests "
        "of the operator's refresh are counted)",
    )
    args = p.parse_args(argv)
    if args.jobs < len(SETTINGS) * len(GROUPS):
        raise SystemExit(f"--jobs at least {len(SETTINGS) * len(GROUPS)}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = run(
        args.jobs,
        args.duration,
        args.recheckpoint,
        lambda s: print(s, flush=True),
        storage_kind=args.storage,
    )
    lines = [
        f"`benchmarks/bench_fleet_kueue.py --jobs {args.jobs} --duration {args.duration:g} "
        f"--recheckpoint {args.recheckpoint:g}"
        f"{' --storage s3' if args.storage == 's3' else ''}` ({started}, {psutil.cpu_count()} CPUs, "
        "local control plane, Kueue and operator on the same machine):",
        "",
        "| measure | value |",
        "|---|---|",
        *[f"| {a} | {b} |" for a, b in rows],
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
