"""The sidecar tests share the replica tests' helpers (small snapshots, the job's secret)."""

from __future__ import annotations

import os
import sys

REPLICA_TESTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "replica")
if REPLICA_TESTS not in sys.path:
    sys.path.insert(0, REPLICA_TESTS)
