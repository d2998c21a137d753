"""pytest fixtures for the end-to-end suite.

* ``cluster`` (session): one LocalCluster (etcd, kube-apiserver, controller-manager,
  scheduler, kwok, training-operator) for the whole session.
* ``namespace`` (function): a fresh namespace per test, deleted afterwards.
* ``--keep-cluster``: leave the cluster running after the session (prints KUBECONFIG and
  the ``python -m ckpt_e2e down ...`` command that stops it); test namespaces are kept.

Binaries come from ``e2e/build-tools.sh`` (run it before pytest: a cold build takes far
longer than a test's timeout). A failed test gets the tails of the component logs and
the events of its namespace appended to its report; the cluster workdir is then kept.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

_E2E = Path(__file__).resolve().parents[1]
if str(_E2E) not in sys.path:  # e2e/ is a source root; fallback when pythonpath lacks it
    sys.path.insert(0, str(_E2E))

from ckpt_e2e import LocalCluster  # noqa: E402

_failed_key = pytest.StashKey[bool]()
_notes_key = pytest.StashKey[list[str]]()


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
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    keep = _keep(request.config)
    c = LocalCluster(
        persistent=keep,
        startup_timeout=float(os.environ.get("CKPT_E2E_STARTUP_TIMEOUT", "180")),
    )
    c.start()
    yield c
    if request.session.stash.get(_failed_key, False):
        c.mark_failed()
    notes = request.config.stash.setdefault(_notes_key, [])
    if keep:
        c.release()
        notes.append(
            f"cluster left running:\n  export KUBECONFIG={c.kubeconfig}\n"
            f"  stop it with: PYTHONPATH={_E2E} python -m ckpt_e2e down {c.workdir}"
        )
    else:
        c.stop()
        if request.session.stash.get(_failed_key, False):
            notes.append(f"a test failed; cluster workdir (logs) kept: {c.workdir}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for note in terminalreporter.config.stash.get(_notes_key, []):
        terminalreporter.write_line(f"[ckpt-e2e] {note}")


def _slug(text: str, limit: int = 30) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"e2e-{_slug(request.node.name)}-{uuid.uuid4().hex[:5]}"
    cluster.create_namespace(name)
    yield name
    if not _keep(request.config):
        cluster.delete_namespace(name, wait=False)


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
