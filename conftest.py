"""Repository-wide pytest hooks.

CI runs the suite on two workers (pytest-xdist ``-n 2 --dist loadgroup``, see
scripts/test.sh). Most tests wait on processes and servers rather than compute, so
two lanes nearly halve the wall time on a 2-core machine. The multi-process
``torch.distributed`` tests are timing-sensitive (gloo timeouts, kill windows):
they form one group that a single worker runs one after another, so two of them
never compete for the cores. Each worker that meets an e2e test starts its own
control plane (session fixtures are per worker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

_DISTRIBUTED = Path(__file__).parent / "tests" / "ckpt_agent" / "distributed"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _DISTRIBUTED in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.xdist_group("distributed"))


# ------------------------------------------------------------------ notes in the summary
# Lines a test or fixture wants in the CI log (the image's size, how the e2e ran the
# operator). Under xdist a worker's output never reaches the terminal, so each worker
# hands its notes to the controller (``workeroutput``), which prints them all once.
_NOTES = pytest.StashKey[list[str]]()
_WORKER_NOTES = "ckpt_summary_notes"


@pytest.fixture(scope="session")
def summary_notes(request: pytest.FixtureRequest) -> list[str]:
    """Append a line here to have it printed in the terminal summary, under xdist too."""
    return request.config.stash.setdefault(_NOTES, [])


@pytest.hookimpl(trylast=True)  # after the runner's final teardown of session fixtures
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: session fixtures are torn down by now
        workeroutput[_WORKER_NOTES] = list(session.config.stash.get(_NOTES, []))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    notes = getattr(node, "workeroutput", {}).get(_WORKER_NOTES, [])
    node.config.stash.setdefault(_NOTES, []).extend(notes)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # each worker that ran the e2e started its own stack: a repeated note once
    for note in dict.fromkeys(terminalreporter.config.stash.get(_NOTES, [])):
        terminalreporter.write_line(note)
