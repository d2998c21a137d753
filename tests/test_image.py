"""The operator image itself: built by scripts/build-images.sh, started with buildah.

The checks of the image are marked ``image`` (deselect with ``-m "not image"``) and
skipped, with the reason, where buildah is missing or the image of the current sources is
not built; ``scripts/test.sh`` builds it first and sets ``CKPT_REQUIRE_IMAGE=1``, which
turns those skips into failures. The helpers' own logic is tested without an image.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_e2e import image as image_mod
from ckpt_e2e.image import (
    REQUIRE_ENV,
    Container,
    expected_tag,
    image_size,
    unavailable_reason,
)

ROOT = Path(__file__).resolve().parents[1]
#: The operator image may not grow past this (uncompressed layers). It is ~450 MB on the
#: Debian base built here (python3 from Debian packages, ~200 MB); less on python:*-slim.
SIZE_BUDGET_MB = 550
OCI_LABELS = {
    "org.opencontainers.image.source": "https://github.com/ckpt-operator/ckpt-operator",
    "org.opencontainers.image.version": "0.1.0",
    "org.opencontainers.image.licenses": "Apache-2.0",
}


@pytest.fixture(scope="module")
def image() -> str:
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    return expected_tag()


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    c = Container(image, role="imagetest").create()
    yield c
    c.remove()


@pytest.mark.image
@pytest.mark.slow
class TestOperatorImage:
    def test_entry_point_is_the_operator_and_answers_help(self, container: Container) -> None:
        assert container.config().get("Entrypoint") == ["ckpt-operator"]
        res = container.run("--help", entrypoint=True)
        assert res.returncode == 0, res.stderr
        assert "usage: ckpt-operator" in res.stdout
        assert "--webhook-cert-dir" in res.stdout

    def test_runs_as_a_non_root_user(self, container: Container) -> None:
        user = str(container.config().get("User") or "")
        assert user and user.split(":", maxsplit=1)[0] not in ("0", "root"), user
        res = container.run("id", "-u")
        assert res.returncode == 0, res.stderr
        assert int(res.stdout) != 0
        # kopf derives its peering identity from the user name: the uid needs a passwd entry
        res = container.run("python", "-c", "import getpass; print(getpass.getuser())")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "ckpt"

    def test_has_no_torch_numpy_or_compilers(self, container: Container) -> None:
        probe = (
            "import importlib.util as u; print([m for m in ('torch', 'numpy') if u.find_spec(m)])"
        )
        res = container.run("python", "-c", probe)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "[]"
        compilers = ("gcc", "cc", "c++", "g++", "clang", "make")
        res = container.run("sh", "-c", f"command -v {' '.join(compilers)} || true")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "", f"compilers in the image: {res.stdout}"

    def test_has_the_oci_labels(self, container: Container) -> None:
        labels = container.config().get("Labels") or {}
        for key, value in OCI_LABELS.items():
            assert labels.get(key) == value, (key, labels)

    def test_size_is_within_budget(self, image: str, summary_notes: list[str]) -> None:
        size_mb = image_size(image) / 1e6
        # in the terminal summary (conftest.py), also under xdist, whose output is lost
        summary_notes.append(f"[image] {image}: {size_mb:.0f} MB (budget {SIZE_BUDGET_MB} MB)")
        assert size_mb < SIZE_BUDGET_MB


# ----------------------------------------------------------------- helpers (no image needed)
def test_mount_targets_follow_the_images_symlinks(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to("/run")
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "lib").symlink_to("usr/lib")
    c = Container("unused")
    c.rootfs = tmp_path
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert c.resolve(sa) == "/run/secrets/kubernetes.io/serviceaccount"
    assert c.resolve("/lib/x/") == "/usr/lib/x"
    assert c.resolve("/etc/ckpt-operator/tls") == "/etc/ckpt-operator/tls"


@pytest.mark.parametrize(
    ("mode", "require", "reason", "want"),
    [
        ("process", "1", None, None),
        ("", "", None, "img:1"),
        ("", "", "no buildah", None),
        ("image", "", None, "img:1"),
        ("image", "", "no buildah", "error"),
        ("", "1", "no buildah", "error"),
        ("docker", "", None, "error"),
    ],
)
def test_operator_mode(
    monkeypatch: pytest.MonkeyPatch, mode: str, require: str, reason: str | None, want: str | None
) -> None:
    monkeypatch.setenv(image_mod.MODE_ENV, mode)
    monkeypatch.setenv(image_mod.REQUIRE_ENV, require)
    monkeypatch.setenv(image_mod.IMAGE_ENV, "img:1")
    monkeypatch.setattr(image_mod, "unavailable_reason", lambda tag=None: reason)
    if want == "error":
        with pytest.raises(image_mod.ImageError):
            image_mod.operator_image()
    else:
        assert image_mod.operator_image() == want


def test_image_tag_follows_the_sources(tmp_path: Path) -> None:
    """--print-tag hashes what the Dockerfile copies: a changed source is a new tag."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "requirements").mkdir()
    for name in (
        "Dockerfile",
        "pyproject.toml",
        "README.md",
        "requirements/operator.lock",
        "scripts/build-images.sh",
    ):
        (tree / name).write_bytes((ROOT / name).read_bytes())
    (tree / "scripts" / "build-images.sh").chmod(0o755)
    for pkg in ("agent/ckpt_agent", "operator/ckpt_operator"):
        (tree / pkg).mkdir(parents=True)
        (tree / pkg / "__init__.py").write_text("")

    def tag() -> str:
        script = tree / "scripts" / "build-images.sh"
        res = subprocess.run([script, "--print-tag"], check=False, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    first = tag()
    assert first.startswith("localhost/ckpt-operator:")
    assert tag() == first
    cache = tree / "operator" / "ckpt_operator" / "__pycache__"
    cache.mkdir()
    (cache / "x.cpython-311.pyc").write_text("x")
    assert tag() == first  # byte code is not a source
    (tree / "operator" / "ckpt_operator" / "__init__.py").write_text("# changed\n")
    second = tag()
    assert second != first
    # the dependency lock pins what the image installs: a new lock is a new image
    with (tree / "requirements" / "operator.lock").open("a") as lock:
        lock.write("# relocked\n")
    assert tag() not in (first, second)


@pytest.mark.skipif(os.geteuid() != 0, reason="build-images.sh runs itself with sudo when not root")
def test_prune_keeps_the_newest_images_of_each_repository(tmp_path: Path) -> None:
    """A build in one tree must not remove the image another tree (a CI clone) is about to use."""
    tag = subprocess.run(
        [ROOT / "scripts" / "build-images.sh", "--print-tag"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    repo = tag.split(":", maxsplit=1)[0]
    images = {  # created (epoch seconds) -> name:tag; the current tree's is not the newest
        500: f"{repo}:newest",
        400: f"{repo}:second",
        300: tag,
        200: f"{repo}:third",
        100: f"{repo}:oldest",
        50: f"{repo}-other:old",  # another repository: never touched
        40: "localhost/ckpt-base:bookworm-1",
        30: "localhost/ckpt-base:bookworm-2",
        20: "localhost/ckpt-base:bookworm-3",
        10: "localhost/ckpt-base:bookworm-4",
    }
    (tmp_path / "images").write_text("".join(f"{k} {v}\n" for k, v in images.items()))
    removed = tmp_path / "removed"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "buildah").write_text(
        "#!/bin/sh\n"
        f'case "$1" in images) cat {tmp_path / "images"} ;; rmi) echo "$2" >> {removed} ;; '
        "*) exit 1 ;; esac\n"
    )
    for name in ("buildah", "mmdebstrap", "setfacl"):
        (fake / name).touch()
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CKPT_IMAGE_KEEP": "3"}
    subprocess.run(
        [ROOT / "scripts" / "build-images.sh", "--prune"], check=True, env=env, timeout=60
    )
    gone = set(removed.read_text().split()) if removed.exists() else set()
    # this tree's image and the two newest others stay, in each repository
    assert gone == {
        f"{repo}:third",
        f"{repo}:oldest",
        "localhost/ckpt-base:bookworm-3",
        "localhost/ckpt-base:bookworm-4",
    }
