"""What the ``ckpt`` commands share: consoles, common options, storage/run/config look-ups."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote, urlsplit

import typer
from rich.console import Console

from ckpt_agent.format.listing import list_checkpoints, list_runs
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage import Storage, StorageError, open_storage

__all__ = [
    "STATUS_STYLE",
    "ConfigOpt",
    "RunOpt",
    "StorageOpt",
    "UsageError",
    "console",
    "err",
    "fail",
    "flags_of",
    "human_size",
    "load_policy",
    "open_store",
    "records_of",
    "say",
    "when",
]

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)

StorageOpt = Annotated[
    str,
    typer.Option(
        "--storage",
        "-s",
        envvar="CKPT_STORAGE_URL",
        help="Storage root: a path, file:///path or s3://bucket/prefix.",
        show_envvar=True,
    ),
]
RunOpt = Annotated[
    str,
    typer.Option(
        "--run-id",
        "-r",
        envvar="CKPT_RUN_ID",
        help="The training run (its folder under the storage root).",
        show_envvar=True,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="CKPT_CONFIG",
        help="Agent config JSON with the retention/recovery policy (default: built-in defaults).",
        show_envvar=True,
        exists=False,
    ),
]


class UsageError(Exception):
    """A mistake in what was asked (exit code 2)."""


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    return typer.Exit(code)


def say(message: str) -> None:
    console.print(message, soft_wrap=True)


def open_store(url: str) -> Storage:
    if not url:
        raise fail("no storage given: pass --storage URL or set CKPT_STORAGE_URL")
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        path = Path(unquote(parts.path) if parts.scheme == "file" else url)
        if not path.is_dir():
            raise fail(
                f"storage directory {path} does not exist (check --storage / CKPT_STORAGE_URL; "
                "the trainer creates it on its first checkpoint)"
            )
    try:
        return open_storage(url)
    except (ValueError, ImportError, StorageError) as e:
        raise fail(f"cannot open storage {url!r}: {e}") from None


def load_policy(path: Path | None) -> AgentConfig:
    if path is None:
        return AgentConfig()
    if not path.is_file():
        raise fail(f"config file {path} does not exist (--config / CKPT_CONFIG)")
    try:
        return AgentConfig.from_json(path.read_text())
    except ValueError as e:
        raise fail(f"config file {path} is not a valid agent config: {e}") from None


def records_of(
    storage: Storage, run_id: str, *, include_heartbeat: bool = True
) -> list[CheckpointRecord]:
    if not run_id:
        raise fail("no run given: pass --run-id ID or set CKPT_RUN_ID")
    try:
        records = list_checkpoints(storage, run_id, include_heartbeat=include_heartbeat)
    except ValueError as e:
        raise fail(str(e)) from None
    except StorageError as e:
        raise fail(f"cannot list {storage.url}: {e}") from None
    if not records:
        runs = list_runs(storage)
        known = ", ".join(runs[:20]) if runs else "none"
        raise fail(f"run {run_id!r} has no checkpoints in {storage.url} (runs there: {known})")
    return records


def human_size(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return str(n)


STATUS_STYLE = {
    CheckpointStatus.VALID: "green",
    CheckpointStatus.PENDING: "yellow",
    CheckpointStatus.CORRUPTED: "bold red",
    CheckpointStatus.EXPIRED: "dim",
}


def flags_of(r: CheckpointRecord) -> str:
    out = []
    if r.lightweight:
        out.append("lightweight")
    if r.approximate:
        out.append("approximate")
    if r.emergency:
        out.append("emergency")
    if r.anomaly:
        out.append(r.anomaly)
    return ",".join(out)


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""
