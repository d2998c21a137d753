"""The Dockerfile lints clean (hadolint) and keeps the properties the chart relies on."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = ROOT / ".venv" / "bin" / "hadolint"
LOCK = ROOT / "requirements" / "operator.lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


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

    Same commands as the Dockerfile: the wheels of the lock (hash-checked, no sdists) and
    of the project, installed with ``--no-index`` into a fresh environment (the lock again
    with ``--require-hashes``, then the project, then ``pip check``), and check that torch
    and numpy are absent and the entry point starts.
    """
    wheels = tmp_path / "wheels"
    venv = tmp_path / "venv"
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels)]
    run([*pip_wheel, "--only-binary=:all:", "--require-hashes", "-r", str(LOCK)])
    run([*pip_wheel, "--no-deps", str(ROOT)])
    run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    pip_install = [str(py), "-m", "pip", "install", "-q", "--no-index", f"--find-links={wheels}"]
    run([*pip_install, "--require-hashes", "-r", str(LOCK)])
    run([*pip_install, "ckpt-operator[operator]"])
    run([str(py), "-m", "pip", "check"])
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


# ----------------------------------------------------------------- dependency lock
def _lock_entries() -> dict[str, tuple[str, int]]:
    """name -> (pinned version, number of sha256 hashes) of requirements/operator.lock."""
    entries: dict[str, tuple[str, int]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text()):
        head = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", block)
        if head is None:
            assert block.startswith("#"), block[:200]
            continue
        hashes = re.findall(r"--hash=sha256:[0-9a-f]{64}\b", block)
        entries[canonicalize_name(head[1])] = (head[2], len(hashes))
    return entries


def test_the_lock_pins_every_operator_dependency_with_hashes() -> None:
    """requirements/operator.lock covers the base dependencies and the operator extra.

    After a change to either in pyproject.toml, run scripts/lock-operator.sh.
    """
    entries = _lock_entries()
    project = PYPROJECT["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for r in project["optional-dependencies"]["operator"]]
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in entries, f"{req} is not in {LOCK.name}: run scripts/lock-operator.sh"
        version = entries[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{LOCK.name} pins {name}=={version}, which {req} excludes: run scripts/lock-operator.sh"
        )
    for name, (version, hashes) in entries.items():
        assert hashes > 0, f"{name}=={version} has no --hash in {LOCK.name}"
    # the operator image's promise: nothing of the agent's training stack
    agent_only = [Requirement(r) for r in project["optional-dependencies"]["agent"]]
    assert not {canonicalize_name(r.name) for r in agent_only} & set(entries)
    assert "scripts/lock-operator.sh" in LOCK.read_text().split("\n", 2)[1]
    assert os.access(ROOT / "scripts" / "lock-operator.sh", os.X_OK)


def test_the_operator_image_installs_exactly_the_lock() -> None:
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert re.search(r"^COPY requirements \./requirements$", stages["source"], re.M)
    wheels = stages["operator-wheels"].replace("\\\n", " ")
    assert re.search(
        r"pip wheel [^&]*--only-binary=:all: --require-hashes\s+-r requirements/operator\.lock",
        wheels,
    ), wheels
    assert "pip wheel --wheel-dir /wheels --no-deps ." in wheels
    final = stages["operator"].replace("\\\n", " ")
    assert re.search(
        r"pip install --no-index --find-links=/wheels --require-hashes"
        r" -r /requirements/operator\.lock",
        final,
    ), final
    assert "pip check" in final
    # the image's tag (scripts/build-images.sh) changes with the lock
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    body = script.split("sources_hash() {", 1)[1].split("\n}\n", 1)[0]
    assert "requirements/operator.lock" in body


def test_one_version_everywhere() -> None:
    """pyproject, both packages, the Dockerfile's label, the chart's appVersion, the image test."""
    version = PYPROJECT["project"]["version"]
    text = DOCKERFILE.read_text()
    found = {
        "Dockerfile ARG VERSION": set(re.findall(r"^ARG VERSION=(\S+)$", text, re.M)),
        "Chart.yaml appVersion": set(
            re.findall(
                r"^appVersion:\s*\"?([^\"\s]+)\"?$",
                (ROOT / "charts" / "ckpt-operator" / "Chart.yaml").read_text(),
                re.M,
            )
        ),
        "tests/test_image.py OCI_LABELS": set(
            re.findall(
                r'"org\.opencontainers\.image\.version": "([^"]+)"',
                (ROOT / "tests" / "test_image.py").read_text(),
            )
        ),
    }
    for path in ("agent/ckpt_agent/version.py", "operator/ckpt_operator/__init__.py"):
        init = (ROOT / path).read_text()
        found[path] = set(re.findall(r'^__version__ = "([^"]+)"$', init, re.M))
    assert len(re.findall(r"^ARG VERSION=", text, re.M)) == 2  # operator and agent stages
    for where, versions in found.items():
        assert versions == {version}, f"{where}: {versions} but pyproject.toml says {version}"
