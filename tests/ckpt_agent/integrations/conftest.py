"""Real Hugging Face ``Trainer`` and Lightning runs, SIGKILLed and resumed (see zygote.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fw_harness import Zygote  # noqa: E402


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    pytest.importorskip("transformers")  # the dcp tests here run without them
    pytest.importorskip("lightning")
    z = Zygote()
    yield z
    z.close()
