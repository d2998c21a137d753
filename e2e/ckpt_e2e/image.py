"""The operator image (``scripts/build-images.sh``) and containers started from it.

The image is built with buildah (storage driver ``vfs``, chroot isolation: no daemon);
``build-images.sh --print-tag`` names the image of the current sources, so a stale image
is never mistaken for the tree under test.

:class:`Container` is a buildah working container from that image; :meth:`Container.argv`
is the ``buildah run --isolation chroot`` command line that starts a command in it the way
a kubelet would start the pod's container: the image's entry point and user (or the pod's
``runAsUser``/``runAsGroup``), volumes bind-mounted at their ``mountPath``, the container's
``env``, plus the host network (chroot isolation has no network namespace: everything
here listens on 127.0.0.1). It has no PID namespace either: the container's processes stay
in the process group of ``buildah run``, so :class:`~ckpt_e2e.procs.ManagedProcess` stops,
kills and freezes them as it does any local process.

``CKPT_E2E_OPERATOR`` picks how the e2e runs the operator: ``image`` (from the image; an
error if it cannot), ``process`` (from this repository's virtualenv), or unset: the image
when :func:`unavailable_reason` finds nothing missing, else the process (but ``image``
under ``CKPT_REQUIRE_IMAGE=1``, which scripts/test.sh sets). ``CKPT_E2E_IMAGE`` names
the image to use instead of the one of the current sources.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from .errors import ClusterError
from .procs import stop_all
from .tools import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-images.sh"
MODE_ENV = "CKPT_E2E_OPERATOR"
IMAGE_ENV = "CKPT_E2E_IMAGE"
#: Set by scripts/test.sh: the image must be there (image tests fail instead of skipping).
REQUIRE_ENV = "CKPT_REQUIRE_IMAGE"
#: buildah with the storage build-images.sh writes (the environment variable: buildah's
#: ``--storage-driver`` flag makes it look elsewhere)
BUILDAH = ["env", f"STORAGE_DRIVER={os.environ.get('STORAGE_DRIVER', 'vfs')}", "buildah"]
#: Working containers are named ``<prefix><pid of the harness>-<random>``.
CONTAINER_PREFIX = "ckpt-e2e-"
_live: set[Container] = set()


class ImageError(ClusterError):
    """The operator image is missing or buildah failed."""


def buildah(
    *args: str, check: bool = True, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """``buildah ARGS`` on the storage ``build-images.sh`` writes."""
    res = subprocess.run(
        [*BUILDAH, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and res.returncode != 0:
        raise ImageError(f"buildah {' '.join(args)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def expected_tag() -> str:
    """The operator image of the current sources (``build-images.sh --print-tag``).

    ``CKPT_E2E_IMAGE`` names another image instead (e.g. one built from an earlier tree).
    """
    return os.environ.get(IMAGE_ENV) or _print_tag()


@functools.cache
def _print_tag() -> str:
    res = subprocess.run(
        [str(BUILD_SCRIPT), "--print-tag"], capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


def unavailable_reason(tag: str | None = None) -> str | None:
    """Why containers cannot be run from the operator image here (None: they can)."""
    if shutil.which("buildah") is None:
        return "buildah is not installed (scripts/build-images.sh installs it and builds the image)"
    if shutil.which("setfacl") is None:
        return "setfacl is not installed (apt package acl; scripts/build-images.sh installs it)"
    if os.geteuid() != 0:
        return "running the image needs root (rootful buildah with chroot isolation)"
    tag = tag or expected_tag()
    if buildah("inspect", "--type", "image", tag, check=False).returncode != 0:
        return f"the image {tag} of the current sources is not built: run scripts/build-images.sh"
    return None


def operator_image() -> str | None:
    """The image the e2e runs the operator from, or None for the local process (``MODE_ENV``)."""
    mode = os.environ.get(MODE_ENV, "").strip().lower()
    setting = f"{MODE_ENV}=image"
    if not mode and os.environ.get(REQUIRE_ENV) == "1":
        mode, setting = "image", f"{REQUIRE_ENV}=1"
    if mode not in ("", "image", "process"):
        raise ImageError(f"{MODE_ENV}={mode!r}: use 'image' or 'process'")
    if mode == "process":
        return None
    reason = unavailable_reason()
    if reason is None:
        return expected_tag()
    if mode == "image":
        raise ImageError(f"{setting} but {reason}")
    return None


def inspect(tag: str) -> dict[str, Any]:
    """``buildah inspect`` of an image: ``OCIv1`` config, ``Manifest``, ..."""
    data: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", tag).stdout)
    return data


def image_size(tag: str) -> int:
    """Bytes of the image's layers, uncompressed (what ``docker images`` shows)."""
    manifest = json.loads(inspect(tag)["Manifest"])
    return sum(int(layer["size"]) for layer in manifest["layers"])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[str]:
    """Remove working containers of e2e harnesses that no longer run (a crashed session)."""
    res = buildah("containers", "--format", "{{.ContainerName}}", check=False)
    removed = []
    for name in res.stdout.split():
        m = re.fullmatch(re.escape(CONTAINER_PREFIX) + r"\w+-(\d+)-[0-9a-f]+", name)
        if m and not _pid_alive(int(m.group(1))):
            buildah("rm", name, check=False)
            removed.append(name)
    return removed


class Container:
    """A buildah working container from ``image`` (created by :meth:`create`)."""

    def __init__(self, image: str, role: str = "operator") -> None:
        self.image = image
        self.name = f"{CONTAINER_PREFIX}{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.created = False
        self.rootfs = Path("/")

    def create(self) -> Self:
        if not self.created:
            remove_orphans()
            buildah("from", "--quiet", "--pull=never", "--name", self.name, self.image)
            self.created = True
            _live.add(self)
            self.rootfs = Path(buildah("mount", self.name).stdout.strip())
        return self

    def resolve(self, path: str) -> str:
        """``path`` with the image's symlinks resolved (``/var/run/x`` is ``/run/x`` on Debian).

        buildah's chroot isolation mounts a volume at the literal path, where a symlink
        in the image hides it; a kubelet's runtime follows the symlink.
        """
        parts = [p for p in path.split("/") if p]
        out: list[str] = []
        for _ in range(40):  # symlink hops
            if not parts:
                break
            head = parts.pop(0)
            link = self.rootfs.joinpath(*out, head)
            if link.is_symlink():
                target = os.readlink(link)
                base = [] if target.startswith("/") else out
                parts = [*base, *(p for p in target.split("/") if p), *parts]
                out = []
            else:
                out.append(head)
        return "/" + "/".join(out)

    def config(self) -> dict[str, Any]:
        """The image's OCI config (``Entrypoint``, ``User``, ``Labels``, ...)."""
        config: dict[str, Any] = inspect(self.image)["OCIv1"]["config"]
        return config

    def argv(
        self,
        command: Sequence[str] | None = None,
        *,
        args: Sequence[str] = (),
        mounts: Mapping[str | Path, str] | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> list[str]:
        """``buildah run`` argv: ``command`` (default: the entry point) + ``args``.

        ``mounts`` maps host paths to paths in the container (read-write bind mounts).
        """
        self.create()
        cmd = list(command) if command is not None else list(self.config().get("Entrypoint") or [])
        opts = ["--isolation", "chroot"]
        for host, target in (mounts or {}).items():
            opts += ["--volume", f"{host}:{self.resolve(target)}"]
        for key, value in (env or {}).items():
            opts += ["--env", f"{key}={value}"]
        if user is not None:
            opts += ["--user", user]
        return [*BUILDAH, "run", *opts, self.name, "--", *cmd, *args]

    def run(
        self, *command: str, entrypoint: bool = False, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (or the entry point with ``command`` as its args) to completion."""
        argv = self.argv(None, args=command) if entrypoint else self.argv(command)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)

    def remove(self) -> None:
        if self.created:
            buildah("rm", self.name, check=False)
            self.created = False
        _live.discard(self)


@atexit.register
def _remove_all() -> None:
    if not _live:
        return
    stop_all()  # the processes running in them first
    for c in list(_live):
        with contextlib.suppress(Exception):
            c.remove()
