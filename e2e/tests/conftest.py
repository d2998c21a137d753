"""pytest fixtures for the end-to-end suite.

* ``cluster`` (session): one LocalCluster (etcd, kube-apiserver, controller-manager,
  scheduler, kwok, training-operator) for the whole session.
* ``namespace`` (function): a fresh namespace per test, deleted afterwards.
* ``stack`` (session): the chart installed with the real ``helm`` (namespace
  ``ckpt-system``) and the operator running in its Deployment's place, as the chart's
  ServiceAccount: from the operator image (``buildah run``) when it is built, else as a
  local process (``CKPT_E2E_OPERATOR=image|process``; see ``ckpt_e2e.stack`` and
  ``ckpt_e2e.image``).
* ``operator`` (function): that operator, (re)started if a previous test killed it; after
  the test, its log must hold no RBAC refusal (403) from the API server.
* ``scenario`` (function): a namespace with a checkpoint PVC, helpers to apply policies
  and PyTorchJobs, and pod runners that run the training pods (``ckpt_e2e.scenario``).
* ``trainer_v2`` (session, opt-in): the real JobSet and Kubeflow Trainer v2 controllers,
  their CRDs and webhooks and the torch ``ClusterTrainingRuntime`` on the session cluster
  (``ckpt_e2e.trainer_v2``); only TrainJob tests request it.
* ``trainjobs`` (function): TrainJob helpers for the test's ``scenario``
  (``ckpt_e2e.trainjob``).
* ``kueue`` (module, opt-in): the real Kueue controller manager, its CRDs and webhooks
  (``ckpt_e2e.kueue``), started for the requesting test module and stopped after it (its
  PyTorchJob webhook must not outlive it), after ``trainer_v2`` (its TrainJob
  integration needs the CRD); only ``test_kueue.py`` requests it.
* ``minio`` (session): a real MinIO server (built by ``e2e/build-tools.sh minio``).
* ``--keep-cluster``: leave the cluster running after the session (prints KUBECONFIG and
  the ``python -m ckpt_e2e down ...`` command that stops it); test namespaces are kept.

Binaries come from ``e2e/build-tools.sh`` (run it before pytest: a cold build takes far
longer than a test's timeout). A failed test gets the tails of the component logs, the
operator's log since the test started and the events of its namespace appended to its
report; the cluster workdir is then kept.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

_E2E = Path(__file__).resolve().parents[1]
if str(_E2E) not in sys.path:  # e2e/ is a source root; fallback when pythonpath lacks it
    sys.path.insert(0, str(_E2E))

from ckpt_e2e import LocalCluster, s3servers  # noqa: E402
from ckpt_e2e.kueue import Kueue  # noqa: E402
from ckpt_e2e.scenario import Scenario  # noqa: E402
from ckpt_e2e.stack import OperatorProcess, Stack  # noqa: E402
from ckpt_e2e.trainer_v2 import TrainerV2  # noqa: E402
from ckpt_e2e.trainjob import TrainJobs  # noqa: E402

_failed_key = pytest.StashKey[bool]()
_op_offset_key = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckpt-e2e")
    group.addoption(
        "--keep-cluster",
        action="store_true",
        default=os.environ.get("CKPT_E2E_KEEP_CLUSTER") == "1",
        help="leave the local e2e cluster (and test namespaces) running after the session",
    )


def _keep(config: pytest.Config) -> bool:
    return bool(config.getoption("--keep-cluster"))


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, summary_notes: list[str]) -> Iterator[LocalCluster]:
    keep = _keep(request.config)
    c = LocalCluster(
        persistent=keep,
        startup_timeout=float(os.environ.get("CKPT_E2E_STARTUP_TIMEOUT", "180")),
    )
    c.start()
    yield c
    if request.session.stash.get(_failed_key, False):
        c.mark_failed()
    if keep:
        c.release()
        _note(
            summary_notes,
            f"cluster left running:\n  export KUBECONFIG={c.kubeconfig}\n"
            f"  stop it with: PYTHONPATH={_E2E} python -m ckpt_e2e down {c.workdir}",
        )
    else:
        c.stop()
        if request.session.stash.get(_failed_key, False):
            _note(summary_notes, f"a test failed; cluster workdir (logs) kept: {c.workdir}")


def _note(notes: list[str], text: str) -> None:
    """A line for the CI log's summary (the root conftest prints ``summary_notes``)."""
    notes.append(f"[ckpt-e2e] {text}")


def _slug(text: str, limit: int = 30) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"e2e-{_slug(request.node.name)}-{uuid.uuid4().hex[:5]}"
    cluster.create_namespace(name)
    yield name
    if not _keep(request.config):
        cluster.delete_namespace(name, wait=False)


@pytest.fixture(scope="session")
def stack(
    cluster: LocalCluster, request: pytest.FixtureRequest, summary_notes: list[str]
) -> Iterator[Stack]:
    st = Stack.up(cluster)
    container = st.operator.container
    # printed by the root conftest.py's terminal summary (also under xdist)
    _note(
        summary_notes,
        f"operator ran from the image {container.image}"
        if container is not None
        else "operator ran as a local process (no image: see CKPT_E2E_OPERATOR)",
    )
    yield st
    if _keep(request.config):  # stays up with the cluster; ``ckpt_e2e down`` stops it too
        st.operator.release()
    else:
        st.down()


@pytest.fixture
def operator(stack: Stack, request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    op = stack.operator
    if not op.running:
        op.start()
    offset = op.log_offset()
    request.node.stash[_op_offset_key] = offset
    yield op
    # Least privilege, checked in use: the chart's RBAC sufficed for everything it did.
    refused = op.forbidden_lines(offset)
    assert not refused, "the API server refused the operator (RBAC):\n" + "\n".join(refused)


@pytest.fixture
def scenario(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> Iterator[Scenario]:
    sc = Scenario(cluster, namespace, operator)
    yield sc
    sc.close()


@pytest.fixture(scope="session")
def trainer_v2(
    cluster: LocalCluster, request: pytest.FixtureRequest, summary_notes: list[str]
) -> Iterator[TrainerV2]:
    tv = TrainerV2(cluster).start()
    _note(summary_notes, f"JobSet + Trainer v2 controllers started in {tv.timings['total']:.1f}s")
    yield tv
    if not _keep(request.config):
        tv.stop()


@pytest.fixture
def trainjobs(trainer_v2: TrainerV2, scenario: Scenario) -> TrainJobs:
    return TrainJobs(scenario)


@pytest.fixture(scope="module")
def kueue(
    cluster: LocalCluster, trainer_v2: TrainerV2, summary_notes: list[str]
) -> Iterator[Kueue]:
    # after trainer_v2: Kueue sets up its TrainJob integration at start only if the CRD is
    # served (else it polls for it with a backoff of up to 2 min)
    kq = Kueue(cluster).start()
    _note(summary_notes, f"Kueue started in {kq.timings['total']:.1f}s")
    yield kq
    kq.stop()  # even with --keep-cluster: its webhooks would refuse every PyTorchJob later


@pytest.fixture(scope="session")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    bin_dir = s3servers.build_tool("minio")
    server = s3servers.start_minio(bin_dir, tmp_path_factory.mktemp("minio"))
    yield server
    server.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        item.session.stash[_failed_key] = True
        funcargs = getattr(item, "funcargs", {})
        c = funcargs.get("cluster")
        if isinstance(c, LocalCluster) and c.procs:
            report.sections.append(("ckpt-e2e component logs", c.diagnostics(max_bytes=3000)))
            op = funcargs.get("operator")
            if isinstance(op, OperatorProcess):
                offset = item.stash.get(_op_offset_key, 0)
                text = op.log_since(offset)
                text = "\n".join(ln for ln in text.splitlines() if "GET /healthz" not in ln)
                report.sections.append(("ckpt-operator log (this test)", text[-12000:]))
            ns = funcargs.get("namespace")
            if isinstance(ns, str):
                ev = c.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
                pods = c.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False)
                report.sections.append(
                    (
                        f"ckpt-e2e namespace {ns}",
                        f"{pods.stdout}{pods.stderr}\n{ev.stdout}{ev.stderr}",
                    )
                )
    return report
