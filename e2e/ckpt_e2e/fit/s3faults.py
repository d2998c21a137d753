"""FIT scenarios 7 and 8: S3 storage through Toxiproxy fails or degrades while saving.

The storage is a real MinIO server; the trainer reaches it only through a real
Toxiproxy (both built from the pinned Go modules, :mod:`ckpt_e2e.s3servers`), started
once per FIT run and shared (``ctx.shared("s3", ...)``). The trainer is the example
run with the agent as a plain local process (:class:`~ckpt_e2e.fit.trainer.FitRun`,
no cluster: a controller restarting the pod is the harness starting it again). The
harness looks at the bucket directly (not through the proxy), so what it sees is
what is really stored.

* ``storage-outage-30s``: the proxy is disabled for 30 s while the run saves (every
  connection refused or cut). Training must go on (saves are deferred, not waited
  for), the failed saves are retried, nothing half-written is marked valid, and saves
  commit again once the storage is back; then the trainer is SIGKILLed and must
  resume, bit-exact, from the newest checkpoint valid at the kill or a newer committed
  one it verified itself (validation lags under load: the shared criterion).
* ``storage-degraded``: 200 ms latency on every connection, ~10 % of connections
  reset by the peer and ~5 % stalled until they time out (toxics with
  ``toxicity``) for the whole run, recovery included: saves still commit, nothing
  corrupt is valid, the SIGKILLed run resumes exactly.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpt_agent.format.layout import commit_key
from ckpt_agent.storage import StorageOptions, open_storage

from ..s3servers import MinioServer, Toxiproxy, build_tool, start_minio, start_toxiproxy
from ..training import Training
from .core import FitContext, Outcome, scenario
from .trainer import RUN_ID, Expectations, FitRun, fit_config, reference, verify_recovery

BUCKET = "ckpt-fit"
PROXY = "minio"
#: The outage issue #14 asks for.
OUTAGE_S = 30.0
#: Longest time without a training step that still counts as "kept training" (the
#: persister is stuck retrying; the trainer must defer its saves, never wait for them).
STALL_LIMIT_S = 3.0
#: The same numbers for both (one reference run); the pacing (``step_sleep``) differs:
#: the outage run must outlive the outage. Resumed attempts run without the pacing.
OUTAGE_RUN = Training(steps=300, seed=13, step_sleep=0.14, samples=512)
DEGRADED_RUN = replace(OUTAGE_RUN, step_sleep=0.05)


@dataclass
class S3Service:
    """MinIO and a Toxiproxy proxy in front of it (name :data:`PROXY`)."""

    minio: MinioServer
    toxiproxy: Toxiproxy

    @property
    def proxied_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.toxiproxy.proxies[PROXY]}"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.toxiproxy.stop()
        self.minio.stop()


def s3_service(ctx: FitContext) -> S3Service:
    """The run's shared MinIO + Toxiproxy (started on first use, stopped at the end)."""

    def start() -> S3Service:
        folder = ctx.work_dir.parent / "s3-servers"
        folder.mkdir(parents=True, exist_ok=True)
        minio = start_minio(build_tool("minio"), folder)
        try:
            minio.client().create_bucket(Bucket=BUCKET)
            proxy = start_toxiproxy(build_tool("toxiproxy"), folder)
        except BaseException:
            minio.stop()
            raise
        service = S3Service(minio, proxy)
        try:
            proxy.create_proxy(PROXY, f"127.0.0.1:{minio.port}")
        except BaseException:
            service.stop()
            raise
        ctx.log(f"s3: MinIO {minio.endpoint}, Toxiproxy {service.proxied_endpoint}")
        return service

    return ctx.shared("s3", start, S3Service.stop)


class S3Run(FitRun):
    """A run whose trainer logs a failed background save and retries it later
    (``--on-persist-error warn``) instead of raising it into the training loop."""

    def argv(self, out: Path) -> list[str]:
        return [*super().argv(out), "--on-persist-error", "warn"]


def s3_run(ctx: FitContext, service: S3Service, training: Training) -> FitRun:
    """A :class:`FitRun` whose agent writes to a fresh prefix through the proxy, watched
    directly in MinIO; closed (and the proxy reset) after the scenario."""
    url = f"s3://{BUCKET}/{ctx.work_dir.name}-{uuid.uuid4().hex[:6]}"
    minio = service.minio
    config = fit_config(
        ctx.work_dir,
        pulse_every=10,
        storageUrl=url,
        s3={"endpoint": service.proxied_endpoint, "pathStyle": True, "maxAttempts": 4},
    )
    env = {
        "CKPT_S3_ACCESS_KEY_ID": minio.access_key,
        "CKPT_S3_SECRET_ACCESS_KEY": minio.secret_key,
        "CKPT_S3_CONNECT_TIMEOUT_S": "1",
        "CKPT_S3_READ_TIMEOUT_S": "3",
        "CKPT_S3_BACKOFF_BASE_S": "0.1",
        "CKPT_S3_BACKOFF_MAX_S": "1",
    }
    look = StorageOptions(
        endpoint_url=minio.endpoint,
        path_style=True,
        access_key_id=minio.access_key,
        secret_access_key=minio.secret_key,
        max_attempts=3,
        backoff_base_s=0.05,
    )
    run = S3Run(
        ctx.work_dir / "run", training, config=config, env=env, storage=open_storage(url, look)
    )
    ctx.cleanups.append(run.close)
    ctx.cleanups.append(service.toxiproxy.reset)
    return run


def _kill_and_recover(ctx: FitContext, outcome: Outcome, run: FitRun, training: Training) -> None:
    """SIGKILL the trainer, start it again unpaced, check the recovery (which checkpoint it
    may resume from: the shared criterion, :func:`~ckpt_e2e.fit.core.restart_may_resume`)."""
    acknowledged = [r.id for r in run.valid()]
    last_step = run.last_step()
    outcome.injected_at = f"{outcome.injected_at}; SIGKILL at step {last_step}"
    detected = run.kill()
    at_fault = run.records()  # the trainer is gone: nothing newer can commit
    run.training = replace(training, step_sleep=0.0)  # pacing only: same numbers
    outcome.check_recovery_time(run.restart_and_time(detected))
    verify_recovery(
        outcome,
        run,
        reference(ctx, training),
        Expectations(acknowledged=acknowledged, last_step_before=last_step, at_fault=at_fault),
    )


def _events(run: FitRun, since: float, until: float) -> list[dict[str, Any]]:
    """The agent's decision-log events between two wall-clock times."""
    try:
        lines = (run.work_dir / "decisions.rank0.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line being written
        if since <= float(event.get("time", 0)) <= until:
            out.append(event)
    return out


def _failed_saves(events: list[dict[str, Any]]) -> int:
    """Background saves the agent reported failed."""
    return sum(
        e.get("event") == "error" and str(e.get("what", "")).startswith("persisting")
        for e in events
    )


def _stalled_s(events: list[dict[str, Any]]) -> float:
    """Seconds the training loop spent in saves: snapshots plus waits for the persister."""
    snapshots = sum(float(e.get("stall_s", 0)) for e in events if e.get("event") == "snapshot")
    waits = sum(
        float(e.get("seconds", 0))
        for e in events
        if e.get("event") == "backpressure" and e.get("action") == "waited"
    )
    return snapshots + waits


def _progress_gap(run: FitRun, until: float) -> tuple[float, int]:
    """Watch the trainer until ``until`` (monotonic): (longest time without a new step,
    steps made)."""
    first = last = run.last_step()
    last_change = time.monotonic()
    gap = 0.0
    while (now := time.monotonic()) < until:
        if not run.current.alive():
            raise RuntimeError(
                f"the trainer exited ({run.current.exitcode}); log {run.current.log}"
            )
        step = run.last_step()
        if step != last:
            last, last_change = step, now
        gap = max(gap, now - last_change)
        time.sleep(0.05)
    return gap, last - first


@scenario(
    "storage-outage-30s",
    "7. S3 (through Toxiproxy) unreachable for 30 s while saving; SIGKILL after",
    needs=("s3", "toxiproxy"),
    expected_s=45.0,
)
def storage_outage(ctx: FitContext) -> Outcome:
    outcome = Outcome("storage-outage-30s")
    service = s3_service(ctx)
    run = s3_run(ctx, service, OUTAGE_RUN)
    reference(ctx, OUTAGE_RUN)  # computed before the trainer runs: it gets both CPUs
    run.start()
    run.wait_for("a valid checkpoint in S3", lambda: bool(run.valid()), timeout=60)
    before = {r.id for r in run.records()}

    service.toxiproxy.set_enabled(PROXY, False)
    start_wall, start = time.time(), time.monotonic()
    outcome.injected_at = f"outage at step {run.last_step()} for {OUTAGE_S:.0f}s"
    ctx.log(f"storage-outage-30s: proxy disabled at step {run.last_step()}")
    try:
        gap, stepped = _progress_gap(run, start + OUTAGE_S)
    finally:
        reachable_from = time.time()  # commits before this instant could not have reached S3
        service.toxiproxy.set_enabled(PROXY, True)
    back = time.time()
    outcome.check(
        "trained on through the outage",
        gap <= STALL_LIMIT_S and stepped > 0,
        f"{stepped} steps in {OUTAGE_S:.0f}s, longest stall {gap:.1f}s (limit {STALL_LIMIT_S}s)",
    )
    events = _events(run, start_wall, back)
    failed = _failed_saves(events)
    outcome.check(
        "failed saves retried during the outage",
        failed >= 2,
        f"{failed} saves failed and were tried again",
    )
    assert run.config is not None
    budget = run.config.scheduler.risk.stall_budget
    stalled = _stalled_s(events)
    outcome.check(
        "stall within the policy's budget",
        stalled <= budget * (back - start_wall),
        f"{stalled:.2f}s in saves over {back - start_wall:.0f}s (stallBudget {budget:g})",
    )
    # When its COMMIT landed in S3 (a save snapshotted during the outage may commit after it:
    # its snapshot time, ``created_at``, says nothing about that).
    during = [
        r.id
        for r in run.records()
        if r.id not in before
        and (run.store.stat(commit_key(RUN_ID, r.id)).mtime or back) < reachable_from
    ]
    outcome.check(
        "nothing committed while the storage was unreachable",
        not during,
        f"{during or 'none'} (outage {back - start_wall:.0f}s)",
    )
    try:
        run.wait_for(
            "a valid checkpoint committed after the outage",
            lambda: any(r.created_at >= back for r in run.valid()),
            timeout=30,
        )
        resumed = True
    except TimeoutError:
        resumed = False
    outcome.check("saves commit again after the outage", resumed, f"within 30s of {back:.0f}")
    _kill_and_recover(ctx, outcome, run, OUTAGE_RUN)
    return outcome


@scenario(
    "storage-degraded",
    "8. S3 through Toxiproxy: 200 ms latency, ~10% of connections reset, ~5% timed out",
    needs=("s3", "toxiproxy"),
    expected_s=30.0,
)
def storage_degraded(ctx: FitContext) -> Outcome:
    outcome = Outcome("storage-degraded")
    service = s3_service(ctx)
    proxy = service.toxiproxy
    run = s3_run(ctx, service, DEGRADED_RUN)
    reference(ctx, DEGRADED_RUN)
    proxy.add_toxic(PROXY, "latency", {"latency": 200, "jitter": 0})
    proxy.add_toxic(PROXY, "reset_peer", {"timeout": 300}, toxicity=0.10, name="reset")
    proxy.add_toxic(PROXY, "timeout", {"timeout": 4000}, toxicity=0.05, name="stall")
    outcome.injected_at = "from the start: 200ms latency, 10% reset, 5% timeout"
    run.start()
    try:
        run.wait_for("three valid checkpoints", lambda: len(run.valid()) >= 3, timeout=90)
        committed = True
    except TimeoutError:
        committed = False
    valid = run.valid()
    outcome.check(
        "saves commit despite the degraded network",
        committed,
        f"{len(valid)} valid by step {run.last_step()}",
    )
    _kill_and_recover(ctx, outcome, run, DEGRADED_RUN)
    return outcome
