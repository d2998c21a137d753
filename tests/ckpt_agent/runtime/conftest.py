"""The runtime's unit tests: :mod:`runtime_fakes` (an Engine over fakes) importable from
every sub-package's tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(autouse=True)
def _close_fake_engines() -> Iterator[None]:
    yield
    import runtime_fakes

    runtime_fakes.close_engines()
