"""Where the pinned Go tools live: built (or reused) by ``e2e/build-tools.sh``.

Each ``e2e/tools/<name>/`` is a Go module; ``build-tools.sh --path <name>`` builds it once
per pin into a versioned cache and prints the folder with its binaries.

Overrides (for debugging, or a machine with binaries from elsewhere):
``CKPT_E2E_BIN_DIR`` — one folder that holds every binary (no build is attempted).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = E2E_DIR.parent
BUILD_SCRIPT = E2E_DIR / "build-tools.sh"
TOOLS_DIR = E2E_DIR / "tools"

# binary name -> tool module that builds it
BINARIES: dict[str, str] = {
    "kube-apiserver": "kubernetes",
    "kube-controller-manager": "kubernetes",
    "kube-scheduler": "kubernetes",
    "kubectl": "kubernetes",
    "etcd": "etcd",
    "kwok": "kwok",
    "helm": "helm",
    "training-operator.v1": "training-operator",
    "jobset": "jobset",
    "trainer-controller-manager": "trainer",
    "kueue": "kueue",
}
# Go names a binary after the last element of its package path (before a /vN suffix).
_GO_OUTPUT_NAME = {"etcd": "server"}


class ToolError(RuntimeError):
    """A tool could not be built or found."""


def build(names: list[str] | None = None, timeout: float = 3600) -> None:
    """Run ``build-tools.sh`` for ``names`` (all tool modules when None)."""
    try:
        subprocess.run(["bash", str(BUILD_SCRIPT), *(names or [])], check=True, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise ToolError(f"build-tools.sh {' '.join(names or [])} failed: {e}") from e


@functools.cache
def tool_dir(module: str, timeout: float = 3600) -> Path:
    """Folder holding the binaries of tool module ``module`` (builds it when needed).

    The one place that asks ``build-tools.sh --path``: the e2e cluster, and the storage
    tests and benchmark for MinIO/Toxiproxy (``tests/ckpt_agent/storage/s3_servers.py``).
    """
    try:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--path", module],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except FileNotFoundError as e:
        raise ToolError(f"cannot run {BUILD_SCRIPT}: {e}") from e
    except subprocess.CalledProcessError as e:
        raise ToolError(
            f"building e2e/tools/{module} failed (is Go >= 1.26 installed?):\n{e.stderr[-4000:]}"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise ToolError(f"building e2e/tools/{module} timed out after {timeout}s") from e
    return Path(out.stdout.strip().splitlines()[-1])


def binary(name: str) -> Path:
    """Absolute path of binary ``name`` (a key of :data:`BINARIES`)."""
    override = os.environ.get("CKPT_E2E_BIN_DIR")
    if override:
        p = Path(override) / name
        if not p.exists():
            raise ToolError(f"{p} not found (CKPT_E2E_BIN_DIR is set)")
        return p
    module = BINARIES[name]
    d = tool_dir(module)
    p = d / _GO_OUTPUT_NAME.get(name, name)
    if not p.exists():
        raise ToolError(f"{p} missing after building e2e/tools/{module}")
    return p


@functools.cache
def module_dir(tool: str, module: str) -> Path:
    """Source folder of Go module ``module`` as pinned by ``e2e/tools/<tool>/go.mod``.

    Used to read files that ship inside a module (e.g. the PyTorchJob CRD) straight from the
    (read-only) Go module cache; ``go mod download`` fetches it if the cache lacks it.
    """
    env = {**os.environ, "GOFLAGS": "-mod=readonly"}
    try:
        out = subprocess.run(
            ["go", "mod", "download", "-json", module],
            cwd=TOOLS_DIR / tool,
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as e:
        raise ToolError(f"cannot locate Go module {module} for e2e/tools/{tool}: {e}") from e
    info = json.loads(out.stdout)
    return Path(info["Dir"])


def pytorchjob_crd() -> Path:
    """The PyTorchJob CRD shipped in the pinned Kubeflow training-operator module."""
    d = module_dir("training-operator", "github.com/kubeflow/training-operator")
    return d / "manifests" / "base" / "crds" / "kubeflow.org_pytorchjobs.yaml"
