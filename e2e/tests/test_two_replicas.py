"""Issue #19: two operator replicas (kopf peering), the active one SIGKILLed mid-burst.

The chart is upgraded to ``operator.peering: true`` with two replicas; both run as local
processes in the Deployment's place (its args, ``--peering`` included), each with its own
webhook port behind a small TCP forwarder on the configured webhook port that sends each
connection to the first replica that accepts it — what the webhook Service does with its
ready endpoints. Exactly one replica is active (the highest random priority), the other
stands by. A burst of opted-in jobs fails at once; an admission gate holds the restarts'
creates on the wire, and once some are in flight (their intents written on the failed
jobs) the active replica is SIGKILLed; a second wave fails while no replica is active.
The survivor takes over once the dead peer's peering lifetime runs out and must finish
the burst: every failed job restarted exactly once (one ``-r1`` each, a restart of its
own job, no ``-r2``), all of them ``Restarted``. Afterwards the chart and the session's
operator are put back.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt_e2e.admission import AdmissionGate
from ckpt_e2e.api import free_port
from ckpt_e2e.errors import ApiError
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.stack import OperatorProcess, Stack, install_chart
from ckpt_e2e.training import Training, annotations_of, list_jobs, operator_status

pytestmark = pytest.mark.e2e

JOB_LABEL = "training.kubeflow.org/job-name"
FIRST_WAVE = 10
SECOND_WAVE = 6
#: kopf's peering lifetime (60 s): a SIGKILLed peer counts as alive until it runs out.
TAKEOVER_S = 75.0


class Forwarder:
    """TCP on ``127.0.0.1:port`` → the first of ``backends`` (127.0.0.1 ports) that accepts."""

    def __init__(self, port: int, backends: Sequence[int]) -> None:
        self.backends = list(backends)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(128)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        for port in self.backends:
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                continue
            upstream.settimeout(None)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join(timeout=30)
            upstream.close()
            break
        client.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _job_pod(scenario: Scenario, job: str) -> str | None:
    path = f"/api/v1/namespaces/{scenario.namespace}/pods?labelSelector={JOB_LABEL}%3D{job}"
    for pod in scenario.cluster.request("GET", path).get("items") or []:
        return str(pod["metadata"]["name"])
    return None


def _fail(scenario: Scenario, pods: dict[str, str], jobs: Sequence[str]) -> None:
    def one(job: str) -> None:
        scenario.cluster.set_pod_exit(scenario.namespace, pods[job], 137)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, jobs))


def _peers(scenario: Scenario) -> dict[str, object]:
    """The ClusterKopfPeering's live entries (peer id → priority, lifetime, last seen)."""
    path = "/apis/kopf.dev/v1/clusterkopfpeerings/ckpt-operator"
    try:
        return dict(scenario.cluster.request("GET", path).get("status") or {})
    except ApiError:
        return {}


def _planned(op: OperatorProcess) -> bool:
    """This replica planned a restart (its ``JobFailed`` Event lines): the active one."""
    return "JobFailed PyTorchJob/" in op.log_since(0)


def _restarted(op: OperatorProcess) -> int:
    """Restarts this replica made (its ``Restarted`` Event lines)."""
    return sum("Restarted PyTorchJob/" in line for line in op.log_since(0).splitlines())


@contextlib.contextmanager
def _two_replicas(stack: Stack) -> Iterator[tuple[OperatorProcess, OperatorProcess]]:
    """The chart with peering and two replicas, both running; everything put back after."""
    cluster, install = stack.cluster, stack.install
    stack.operator.stop()
    replicas: list[OperatorProcess] = []
    forwarder: Forwarder | None = None
    try:
        peered = install_chart(
            cluster,
            release=install.release,
            namespace=install.namespace,
            webhook_port=install.webhook_port,
            values={"replicaCount": 2, "operator": {"peering": True}},
        )
        ports = [free_port(), free_port()]
        forwarder = Forwarder(install.webhook_port, ports)
        for i, port in enumerate(ports):
            op = OperatorProcess(cluster, peered, extra_args=[f"--webhook-port={port}"])
            op.dir = cluster.workdir / f"operator-peer{i}"
            op.tls_dir = op.dir / "tls"
            op.log_path = cluster.log_dir / f"ckpt-operator-peer{i}.log"
            replicas.append(op.start())
        yield replicas[0], replicas[1]
    finally:
        for op in replicas:
            op.kill()
        if forwarder is not None:
            forwarder.close()
        install_chart(
            cluster,
            release=install.release,
            namespace=install.namespace,
            webhook_port=install.webhook_port,
            values=install.values,
        )
        stack.operator.start()


def test_one_of_two_replicas_killed_mid_burst_every_job_restarted_once(
    scenario: Scenario, stack: Stack
) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    scenario.apply_policy("e2e", recovery={"backoffSeconds": 0})
    scenario.runner(decide=lambda pod: "ignore")  # nothing trains: failures are reported
    names = [f"job-{i:02d}" for i in range(FIRST_WAVE + SECOND_WAVE)]

    with _two_replicas(stack) as (a, b):
        cluster.wait_for(
            lambda: len(_peers(scenario)) >= 2, timeout=60, what="both replicas peering"
        )
        time.sleep(2)  # the lower priority pauses on seeing the other
        for name in names:
            scenario.submit(name, Training(steps=5))
        pods = {
            name: str(cluster.wait_for(functools.partial(_job_pod, scenario, name), 120, name))
            for name in names
        }
        first, second = names[:FIRST_WAVE], names[FIRST_WAVE:]
        with AdmissionGate(cluster, ns) as gate:
            # the restarts' creates are held on the wire: intents written, creates in flight
            gate.hold(r"job-\d+-r1")
            _fail(scenario, pods, first)
            cluster.wait_for(lambda: len(gate.calls) >= 3, 60, "restart creates in flight")
            active, survivor = (a, b) if _planned(a) else (b, a)
            active.kill()  # mid-burst, mid-restart
            killed_at = time.monotonic()
            in_flight = [
                n for n in first if operator_status(scenario.job(n)).get("state") == "Restarting"
            ]
            assert in_flight, "no restart was in flight when the active replica died"
            gate.stop_holding()
        _fail(scenario, pods, second)  # the burst goes on with no active replica

        def all_restarted() -> bool:
            return all(
                operator_status(scenario.job(name) or {}).get("state") == "Restarted"
                for name in names
            )

        cluster.wait_for(all_restarted, timeout=TAKEOVER_S + 60, what="every job Restarted")
        took = time.monotonic() - killed_at
        time.sleep(3)  # give a duplicate the chance to show up
        jobs = {j["metadata"]["name"]: j for j in list_jobs(cluster, ns)}
        assert survivor.running and not active.running
        assert _restarted(survivor) >= SECOND_WAVE + len(in_flight), survivor.tail()
        assert _restarted(active) == 0
        assert not survivor.forbidden_lines(), survivor.forbidden_lines()

    assert sorted(jobs) == sorted([*names, *(f"{n}-r1" for n in names)]), sorted(jobs)
    for name in names:
        ann = annotations_of(jobs[f"{name}-r1"])
        assert ann["ckpt.dev/restart-of"] == name
        assert ann["ckpt.dev/restart-count"] == "1"
    print(
        f"{len(in_flight)} restart(s) in flight at the kill; all {len(names)} done by the "
        f"survivor within {took:.0f}s of it"
    )
