"""Real MinIO and Toxiproxy processes on 127.0.0.1 for tests, benchmarks and the FIT suite.

Binaries come from the pinned Go tool modules ``e2e/tools/minio`` and
``e2e/tools/toxiproxy`` through ``e2e/build-tools.sh`` (built once, then cached
by module hash; :func:`ckpt_e2e.tools.tool_dir` asks it). Every process is started with a
temp data dir and a free port, waited for with a bounded readiness probe and stopped on
teardown. Used by the storage tests (``tests/ckpt_agent/storage/s3_servers.py`` re-exports
it), ``benchmarks/bench_storage.py``, the e2e ``minio`` fixture and the FIT storage
scenarios (:mod:`ckpt_e2e.fit.s3faults`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_agent.storage import StorageOptions

from .api import free_port
from .tools import ToolError, tool_dir

MINIO_USER = "ckpt-test-admin"
MINIO_PASSWORD = "ckpt-test-secret-0123456789"
#: MinIO's built-in single-key KMS (MINIO_KMS_SECRET_KEY): enables SSE-S3 and SSE-KMS.
KMS_KEY_NAME = "ckpt-test-key"
_KMS_KEY = base64.b64encode(bytes(range(32))).decode()


class ServerError(RuntimeError):
    """A test server could not be built or started."""


def build_tool(name: str, timeout_s: float = 3600) -> Path:
    """``e2e/build-tools.sh --path NAME`` → the folder holding the tool's binaries."""
    try:
        return tool_dir(name, timeout_s)
    except ToolError as e:
        raise ServerError(str(e)) from e


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{url}: process exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.2)
    raise ServerError(f"{url} not ready after {timeout_s}s ({last}):\n{_tail(log)}")


def _tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def _start_on_free_port(
    name: str,
    argv: Callable[[int], list[str]],
    ready_path: str,
    workdir: Path,
    env: dict[str, str],
    timeout_s: float,
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """Start ``argv(port)`` on a free port (log ``<workdir>/<name, lower case>-<port>.log``), wait
    until ``ready_path`` answers 200; three tries (the port may be taken in between)."""
    last: Exception | None = None
    for _ in range(3):  # the free port may be taken between probe and bind
        port = free_port()
        log = workdir / f"{name.lower()}-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv(port),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )
        try:
            _wait_http(f"http://127.0.0.1:{port}{ready_path}", proc, timeout_s, log)
        except ServerError as e:
            _stop(proc)
            last = e
            continue
        return proc, port, log
    raise ServerError(f"{name} did not start: {last}")


@dataclass
class MinioServer:
    """One ``minio server`` process (single drive) with the built-in KMS key."""

    proc: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log: Path
    version: str = ""
    access_key: str = MINIO_USER
    secret_key: str = MINIO_PASSWORD
    kms_key: str = KMS_KEY_NAME

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, endpoint: str | None = None) -> Any:
        """A raw boto3 client (botocore retries off) for setup and assertions."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=5,
                read_timeout=30,
            ),
        )

    def storage_options(self, **overrides: Any) -> StorageOptions:
        """Our backend's options for this server: its endpoint (path style, us-east-1)
        and root keys; ``overrides`` replace any of them (e.g. a proxy's endpoint)."""
        base: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "region": "us-east-1",
            "path_style": True,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }
        return StorageOptions(**(base | overrides))

    def stop(self) -> None:
        _stop(self.proc)


def start_minio(
    bin_dir: Path,
    workdir: Path,
    timeout_s: float = 60,
    extra_env: dict[str, str] | None = None,
) -> MinioServer:
    """Start ``minio server`` on a free port; ``extra_env`` adds MINIO_* settings."""
    exe = bin_dir / "minio"
    if not exe.exists():
        raise ServerError(f"no minio binary in {bin_dir}")
    version = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout.splitlines()[:1]
    data = workdir / "minio-data"
    data.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(workdir),
        "MINIO_ROOT_USER": MINIO_USER,
        "MINIO_ROOT_PASSWORD": MINIO_PASSWORD,
        "MINIO_KMS_SECRET_KEY": f"{KMS_KEY_NAME}:{_KMS_KEY}",
        "MINIO_BROWSER": "off",
        "MINIO_UPDATE": "off",
        "MINIO_CI_CD": "on",
        **(extra_env or {}),
    }
    proc, port, log = _start_on_free_port(
        "MinIO",
        lambda port: [str(exe), "server", "--quiet", "--address", f"127.0.0.1:{port}", str(data)],
        "/minio/health/ready",
        workdir,
        env,
        timeout_s,
    )
    return MinioServer(proc, port, data, log, version[0] if version else "")


@dataclass
class Toxiproxy:
    """A ``toxiproxy-server`` process driven through its HTTP API."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    version: str = ""
    proxies: dict[str, int] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _req(self, method: str, path: str, body: object | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.api + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"toxiproxy {method} {path}: {e.code} {e.read()!r}") from e
        return json.loads(raw) if raw.strip() else None

    def create_proxy(self, name: str, upstream: str) -> str:
        """A proxy on a free port to ``upstream`` (host:port); returns its listen address."""
        for _ in range(3):
            port = free_port()
            try:
                self._req(
                    "POST",
                    "/proxies",
                    {
                        "name": name,
                        "listen": f"127.0.0.1:{port}",
                        "upstream": upstream,
                        "enabled": True,
                    },
                )
            except ServerError:
                continue
            self.proxies[name] = port
            return f"127.0.0.1:{port}"
        raise ServerError(f"could not create toxiproxy proxy {name}")

    def add_toxic(
        self,
        proxy: str,
        kind: str,
        attributes: dict[str, int],
        *,
        stream: str = "downstream",
        name: str | None = None,
        toxicity: float = 1.0,
    ) -> str:
        name = name or f"{kind}_{stream}"
        self._req(
            "POST",
            f"/proxies/{proxy}/toxics",
            {
                "name": name,
                "type": kind,
                "stream": stream,
                "toxicity": toxicity,
                "attributes": attributes,
            },
        )
        return name

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._req("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def set_enabled(self, proxy: str, enabled: bool) -> None:
        self._req("POST", f"/proxies/{proxy}", {"enabled": enabled})

    def reset(self) -> None:
        """Enable all proxies and remove all toxics."""
        self._req("POST", "/reset")

    @contextlib.contextmanager
    def toxic(self, proxy: str, kind: str, attributes: dict[str, int], **kw: Any) -> Iterator[str]:
        name = self.add_toxic(proxy, kind, attributes, **kw)
        try:
            yield name
        finally:
            with contextlib.suppress(ServerError):
                self.remove_toxic(proxy, name)

    def stop(self) -> None:
        _stop(self.proc)


def _toxiproxy_exe(bin_dir: Path) -> Path:
    for name in ("toxiproxy-server", "server"):
        if (bin_dir / name).exists():
            return bin_dir / name
    raise ServerError(f"no toxiproxy server binary in {bin_dir}")


def start_toxiproxy(bin_dir: Path, workdir: Path, timeout_s: float = 30) -> Toxiproxy:
    exe = _toxiproxy_exe(bin_dir)
    version = subprocess.run(
        [str(exe), "-version"], capture_output=True, text=True, timeout=30, check=False
    )
    proc, port, log = _start_on_free_port(
        "toxiproxy",
        lambda port: [str(exe), "-host", "127.0.0.1", "-port", str(port)],
        "/version",
        workdir,
        {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir)},
        timeout_s,
    )
    text = (version.stdout + version.stderr).strip().splitlines()
    return Toxiproxy(proc, port, log, text[0] if text else "")
