"""Real MinIO and Toxiproxy processes for the storage tests and the benchmark.

The launcher lives in the e2e harness (:mod:`ckpt_e2e.s3servers`) so that the FIT suite
uses the same one; this module re-exports it for ``conftest.py`` and
``benchmarks/bench_storage.py`` (which load it by path). Not a test module.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# e2e/ is a source root: pytest's pythonpath has it, benchmarks/bench_storage.py does not
if str(REPO / "e2e") not in sys.path:
    sys.path.insert(0, str(REPO / "e2e"))

from ckpt_e2e.s3servers import (  # noqa: E402
    KMS_KEY_NAME,
    MINIO_PASSWORD,
    MINIO_USER,
    MinioServer,
    ServerError,
    Toxiproxy,
    build_tool,
    start_minio,
    start_toxiproxy,
)

__all__ = [
    "KMS_KEY_NAME",
    "MINIO_PASSWORD",
    "MINIO_USER",
    "MinioServer",
    "ServerError",
    "Toxiproxy",
    "build_tool",
    "start_minio",
    "start_toxiproxy",
]
