"""Fixtures for the storage tests: both backends, a real MinIO, a real Toxiproxy, a real
1 MiB tmpfs (``tiny_tmpfs``, root only) and the mount helpers the filesystem tests share.

The ``storage`` fixture runs each conformance test against the filesystem
backend and against MinIO (``pytest.mark.s3``). MinIO and Toxiproxy are built
from the pinned Go modules in ``e2e/tools/`` right after collection when any
selected test needs them (a cold MinIO build takes minutes; later runs reuse the
cache), then started once per session on 127.0.0.1 with free ports and temp
data dirs, and stopped at the end. A build or start failure errors the S3 tests
(it never skips them); deselect them with ``-m "not s3"``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from ckpt_agent.storage import Storage, StorageOptions
from ckpt_agent.storage.fs import LocalStorage
from ckpt_e2e import s3servers as servers

BUCKET = "ckpt-test"
_tools: dict[str, Path | Exception] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the Go tools before any test runs (outside the per-test timeout)."""
    if not any(item.get_closest_marker("s3") for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for name in ("minio", "toxiproxy"):
        t0 = time.monotonic()
        if reporter is not None:
            reporter.write_line(f"storage tests: building/locating {name} (e2e/build-tools.sh) ...")
        try:
            _tools[name] = servers.build_tool(name)
        except Exception as e:
            _tools[name] = e
        if reporter is not None:
            reporter.write_line(
                f"storage tests: {name}: {_tools[name]} ({time.monotonic() - t0:.0f}s)"
            )


def _tool(name: str) -> Path:
    got = _tools.get(name)
    if got is None:
        got = _tools[name] = servers.build_tool(name)
    if isinstance(got, Exception):
        raise got
    return got


@pytest.fixture(scope="session")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    server = servers.start_minio(_tool("minio"), tmp_path_factory.mktemp("minio"))
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def throttled_minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A second MinIO that admits one request at a time and answers the rest with a real
    throttling error (HTTP 503 TooManyRequests) after 200 ms in its queue."""
    server = servers.start_minio(
        _tool("minio"),
        tmp_path_factory.mktemp("minio-throttled"),
        extra_env={"MINIO_API_REQUESTS_MAX": "1", "MINIO_API_REQUESTS_DEADLINE": "200ms"},
    )
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def toxiproxy(tmp_path_factory: pytest.TempPathFactory, minio: Any) -> Iterator[Any]:
    proxy = servers.start_toxiproxy(_tool("toxiproxy"), tmp_path_factory.mktemp("toxiproxy"))
    try:
        proxy.create_proxy("minio", f"127.0.0.1:{minio.port}")
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def toxi(toxiproxy: Any) -> Iterator[Any]:
    """The session Toxiproxy, reset (enabled, no toxics) before and after the test."""
    toxiproxy.reset()
    yield toxiproxy
    toxiproxy.reset()


def s3_options(endpoint: str, minio: Any, **overrides: Any) -> StorageOptions:
    """Options for our backend against the test MinIO: 5 MiB parts, quick backoff."""
    base: dict[str, Any] = {
        "endpoint_url": endpoint,
        "path_style": None,  # as a user leaves it: on for a custom endpoint
        "part_size_bytes": 5 * 1024 * 1024,
        "max_concurrency": 3,
        "max_attempts": 3,
        "backoff_base_s": 0.05,
        "backoff_max_s": 0.5,
        "connect_timeout_s": 3,
        "read_timeout_s": 20,
    }
    base.update(overrides)
    return cast(StorageOptions, minio.storage_options(**base))


@pytest.fixture
def make_s3(minio: Any) -> Iterator[Any]:
    """Factory: ``make_s3(endpoint=None, bucket=BUCKET, prefix=None, **options)`` → S3Storage
    (a fresh prefix unless given)."""
    from ckpt_agent.storage.s3 import S3Storage

    made: list[S3Storage] = []

    def make(
        endpoint: str | None = None,
        bucket: str = BUCKET,
        prefix: str | None = None,
        **overrides: Any,
    ) -> S3Storage:
        opts = s3_options(endpoint or minio.endpoint, minio, **overrides)
        store = S3Storage(bucket, prefix or f"t-{uuid.uuid4().hex[:12]}", opts)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def proxied_endpoint(toxi: Any) -> str:
    return f"http://127.0.0.1:{toxi.proxies['minio']}"


@pytest.fixture(params=["fs", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    """The backend under test (conformance suite): a fresh, empty root."""
    store: Storage
    if request.param == "fs":
        store = LocalStorage(tmp_path / "root")
    else:
        store = request.getfixturevalue("make_s3")()
    yield store
    store.close()


# --------------------------------------------------------------------------- mounts

IS_ROOT = os.geteuid() == 0


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def mounted(args: list[str], target: Path) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem."""
    if not IS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    with mounted(["-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], mnt):
        yield mnt
