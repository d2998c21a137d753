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

import pytest

_DISTRIBUTED = Path(__file__).parent / "tests" / "ckpt_agent" / "distributed"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _DISTRIBUTED in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.xdist_group("distributed"))
