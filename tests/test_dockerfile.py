"""The Dockerfile lints clean (hadolint) and keeps the properties the chart relies on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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
