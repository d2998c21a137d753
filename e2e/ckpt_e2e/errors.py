"""The harness's errors, in one module that every other one may import."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


class ClusterError(RuntimeError):
    """The local cluster failed to start or a client command failed."""


class ApiError(ClusterError):
    """The API server answered a request made by :meth:`KubeClient.request` with an error."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:2000]}")


class CommandError(ClusterError):
    """``kubectl``/``helm`` exited non-zero."""

    def __init__(self, argv: Sequence[str], result: subprocess.CompletedProcess[str]) -> None:
        self.argv = list(argv)
        self.result = result
        super().__init__(
            f"{' '.join(self.argv)} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
        )


class LocalPodError(RuntimeError):
    """The pod cannot be run locally, or its exit could not be reported."""
