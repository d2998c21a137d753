"""The Dockerfile lints clean (hadolint) and keeps the properties the chart relies on."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = ROOT / ".venv" / "bin" / "hadolint"


def test_hadolint_clean() -> None:
    out = subprocess.run(
        [str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _stages(text: str) -> dict[str, str]:
    parts = re.split(r"^FROM\s+", text, flags=re.M)
    out = {}
    for part in parts[1:]:
        header, _, body = part.partition("\n")
        name = header.split(" AS ")[-1].strip() if " AS " in header else header.strip()
        out[name] = header + "\n" + body
    return out


def test_targets_are_non_root_and_pinned() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-\w+$", text, re.M)
    stages = _stages(text)
    assert {"operator", "agent"} <= set(stages)
    for target in ("operator", "agent"):
        users = re.findall(r"^USER\s+(\S+)", stages[target], re.M)
        assert users and users[-1].split(":")[0] not in ("0", "root")
    # the operator image installs only the operator extra and proves torch is absent
    assert '"ckpt-operator[operator]==' in stages["operator"]
    assert "torch" not in stages["operator"].replace("'torch', 'numpy'", "")
    assert "find_spec" in stages["operator"]
    assert '"ckpt-operator[agent]==' in stages["agent"]
    assert 'ENTRYPOINT ["ckpt-operator"]' in stages["operator"]


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "tests", "e2e"):
        assert entry in ignored


@pytest.mark.slow
def test_operator_image_install_steps_give_a_torch_free_operator(tmp_path: Path) -> None:
    """Replays the operator stage's install steps (no Docker engine here).

    Same commands as the Dockerfile: build the wheels of ``.[operator]``, install them
    with ``--no-index`` into a fresh environment, and check that torch and numpy are
    absent and the entry point starts.
    """
    wheels = tmp_path / "wheels"
    venv = tmp_path / "venv"
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--wheel-dir",
            str(wheels),
            f"{ROOT}[operator]",
        ]
    )
    run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            f"--find-links={wheels}",
            "ckpt-operator[operator]",
        ]
    )
    probe = run(
        [
            str(py),
            "-c",
            "import importlib.util as u; print([m for m in ('torch', 'numpy') if u.find_spec(m)])",
        ]
    )
    assert probe.stdout.strip() == "[]", probe.stdout
    helped = run([str(venv / "bin" / "ckpt-operator"), "--help"])
    assert "usage" in helped.stdout.lower()


def test_images_carry_oci_labels_a_named_user_and_a_base_argument() -> None:
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    # the base is a build argument (scripts/build-images.sh passes a locally made one)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\} AS base$", text, re.M)
    for target in ("operator", "agent"):
        for label in ("source", "version", "licenses"):
            assert f"org.opencontainers.image.{label}=" in stages[target], (target, label)
    # USER 65532 has a passwd entry (kopf's getpass.getuser() fails without one)
    assert re.search(r"useradd --uid 65532 --gid 65532 .*ckpt", stages["base"].replace("\\\n", ""))
    # pip in the wheel stages honours a private index given as a build argument
    for stage in ("operator-wheels", "agent-wheels"):
        assert re.search(r"^ARG PIP_INDEX_URL$", stages[stage], re.M), stage
