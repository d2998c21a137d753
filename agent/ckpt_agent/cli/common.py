"""What the ``ckpt`` commands share: consoles, common options, storage/run/config look-ups,
exit codes, and the two guards against hostile storage.

Everything a command shows that came from storage (run ids, checkpoint fields,
reasons, validation messages, error texts) goes through :func:`safe` (or
:func:`plain` for text composed into a message) before it reaches rich: rich
markup is escaped and the text goes through the one sanitizer,
:func:`ckpt_agent.text.clean` (control and bidi characters, ANSI/OSC sequences
included, spelled out as ``\\x1b``, ``\\u202e``; length capped), so stored
bytes can neither style, move nor clear the operator's terminal. Every command is
wrapped by :func:`guarded`: an error is one line on stderr and an
:class:`ExitCode`, never a traceback; and the warnings other layers log while it
runs (a planted file name skipped by a listing) are printed through
:class:`ckpt_agent.text.CleanFormatter` (:func:`ckpt_agent.text.install_clean_last_resort`).
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, ParamSpec
from urllib.parse import unquote, urlsplit

import typer
from rich.console import Console
from rich.markup import escape

from ckpt_agent.errors import CkptError, UnsafePathError
from ckpt_agent.format.listing import list_checkpoints, list_runs
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage import Storage, StorageError, StorageOptions, open_storage
from ckpt_agent.text import DEFAULT_LIMIT, clean, install_clean_last_resort

__all__ = [
    "EXIT_CODES_HELP",
    "STATUS_STYLE",
    "ConfigOpt",
    "ExitCode",
    "RunOpt",
    "StorageOpt",
    "UsageError",
    "console",
    "err",
    "fail",
    "flags_of",
    "guarded",
    "human_size",
    "is_seconds",
    "load_policy",
    "non_negative",
    "open_store",
    "plain",
    "records_of",
    "safe",
    "say",
    "when",
]

P = ParamSpec("P")
log = logging.getLogger(__name__)

#: Longest stored string shown in a table cell or a message (a reason can be kilobytes).
SHOWN_MAX = DEFAULT_LIMIT


class ExitCode(enum.IntEnum):
    """What a ``ckpt`` exit status means (listed in ``--help``)."""

    OK = 0
    PROBLEM = 1  # the data has a problem: corrupted checkpoint, nothing to recover, GC skipped
    USAGE = 2  # a mistake in what was asked: option value, missing directory, unknown run/step
    STORAGE = 3  # the storage failed or refused (permissions, credentials, I/O, unreachable)
    UNSAFE = 4  # a link or special file planted in the storage was refused (never followed)
    DATA = 5  # stored checkpoint data is malformed beyond what the command reports itself
    INTERNAL = 70  # a bug in ckpt (set CKPT_DEBUG=1 to see the traceback, and report it)


EXIT_CODES_HELP = (
    "Exit codes: 0 fine; 1 a problem was found (corrupted data, nothing to recover, "
    "blob GC skipped); 2 bad usage (option value, missing directory, unknown run or step); "
    "3 storage failed (permissions, credentials, I/O); 4 unsafe storage (a planted link or "
    "special file was refused); 5 malformed checkpoint data; 70 internal error "
    "(CKPT_DEBUG=1 shows the traceback)."
)

console = Console(highlight=False, emoji=False)
err = Console(stderr=True, highlight=False, emoji=False)

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
        help="Agent config JSON: the retention/recovery policy and the S3 section (endpoint, "
        "region, part size, attempts) applied over CKPT_S3_* (default: built-in defaults).",
        show_envvar=True,
        exists=False,
    ),
]


class UsageError(Exception):
    """A mistake in what was asked (exit code 2)."""


def plain(value: object, limit: int | None = SHOWN_MAX) -> str:
    """``value`` as one line of harmless text (:func:`ckpt_agent.text.clean`): control
    characters (ANSI escape sequences, newlines, bidi overrides ...) spelled out as
    ``\\x1b``, ``\\n``, ``\\u202e``; at most ``limit`` characters. For text composed into
    a message (then :func:`fail`)."""
    return clean(value, limit)


def safe(value: object, limit: int | None = SHOWN_MAX) -> str:
    """:func:`plain`, with rich markup escaped: for a stored string shown by rich."""
    return escape(plain(value, limit))


def fail(message: str, code: int = ExitCode.USAGE) -> typer.Exit:
    """Print ``error: message`` (one line, shown as plain text) and return the exit to raise."""
    err.print(f"[bold red]error:[/] {safe(message, None)}", soft_wrap=True)
    return typer.Exit(int(code))


def say(message: str) -> None:
    """Print rich markup: every stored value in it must have gone through :func:`safe`."""
    console.print(message, soft_wrap=True)


def explain(e: Exception) -> typer.Exit:
    """The one-line message and exit code for an error a command did not handle itself."""
    why = plain(e)
    if isinstance(e, UnsafePathError):
        return fail(
            f"unsafe storage: {why}. Something other than a regular file or folder (a symbolic "
            "link, FIFO or device) sits where checkpoint data belongs; it was refused, not "
            "followed. Someone with write access to the storage put it there: inspect and "
            "remove it, then run the command again.",
            ExitCode.UNSAFE,
        )
    if isinstance(e, StorageError | OSError):
        hint = (
            "it looks transient: try again"
            if isinstance(e, CkptError) and e.retryable
            else "check --storage, the permissions of this user and the credentials"
        )
        return fail(f"storage failed: {why} ({hint})", ExitCode.STORAGE)
    if isinstance(e, CkptError):
        return fail(
            f"malformed checkpoint data: {why}. Run `ckpt verify --all` to see which "
            "checkpoints are damaged.",
            ExitCode.DATA,
        )
    if isinstance(e, UsageError):
        return fail(why, ExitCode.USAGE)
    return fail(
        f"internal error: {type(e).__name__}: {why}. This is a bug in ckpt: run again with "
        "CKPT_DEBUG=1 to see the traceback, and report it.",
        ExitCode.INTERNAL,
    )


def guarded(command: Callable[P, None]) -> Callable[P, None]:
    """Wrap a command: an error it does not handle becomes one line and an :class:`ExitCode`
    (:func:`explain`), never a traceback; ``CKPT_DEBUG=1`` re-raises it."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        install_clean_last_resort()  # other layers' warnings name stored files: cleaned
        try:
            command(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except Exception as e:
            if os.environ.get("CKPT_DEBUG"):
                raise
            log.debug("ckpt %s failed", command.__name__, exc_info=True)
            raise explain(e) from None

    return run


def is_seconds(value: float) -> bool:
    """Whether ``value`` is a usable duration: finite and ≥ 0 (not ``nan``, ``inf``, -1)."""
    return math.isfinite(value) and value >= 0


def non_negative(value: float | None) -> float | None:
    """Option callback: a finite number ≥ 0 (``nan``, ``inf`` and negatives are usage errors)."""
    if value is not None and not is_seconds(value):
        raise typer.BadParameter(f"{value!r} is not a finite number of seconds >= 0")
    return value


def open_store(url: str, config: AgentConfig | None = None) -> Storage:
    """Open ``url`` with the options the trainer uses (:meth:`StorageOptions.for_config
    <ckpt_agent.storage.options.StorageOptions.for_config>`): the ``CKPT_S3_*`` environment
    with ``config``'s S3 section (``--config``: endpoint, region, part size, attempts) over it."""
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
    cfg = (config or AgentConfig()).model_copy(update={"storage_url": url})
    try:
        return open_storage(url, StorageOptions.for_config(cfg))
    except StorageError:
        raise  # unreachable, refused, unsafe: guarded() explains it (exit code 3 or 4)
    except (ValueError, ImportError) as e:
        raise fail(f"cannot open storage {url!r}: {plain(e)}") from None


def load_policy(path: Path | None) -> AgentConfig:
    if path is None:
        return AgentConfig()
    if not path.is_file():
        raise fail(f"config file {path} does not exist (--config / CKPT_CONFIG)")
    try:
        return AgentConfig.from_json(path.read_text())
    except (ValueError, OSError) as e:
        raise fail(f"config file {path} is not a readable agent config: {plain(e)}") from None


def records_of(
    storage: Storage, run_id: str, *, include_heartbeat: bool = True
) -> list[CheckpointRecord]:
    if not run_id:
        raise fail("no run given: pass --run-id ID or set CKPT_RUN_ID")
    try:
        records = list_checkpoints(storage, run_id, include_heartbeat=include_heartbeat)
    except CkptError:
        raise  # storage or data: guarded() explains it
    except ValueError as e:  # not a run id
        raise fail(plain(e)) from None
    if not records:
        runs = list_runs(storage)
        known = ", ".join(runs[:20]) if runs else "none"
        raise fail(f"run {run_id!r} has no checkpoints in {storage.url} (runs there: {known})")
    return records


def human_size(n: int) -> str:
    """``n`` bytes for people; a stored size that is not a sane count shows as ``?``."""
    if isinstance(n, bool) or not isinstance(n, int | float) or not 0 <= n < 1024**6:
        return f"? ({n!r:.24})"
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
    """The record's flags, comma-separated (plain text: pass it through :func:`safe`)."""
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
    """A stored unix time as local time; one that is not a sane time shows as ``?``."""
    if not t:
        return ""
    try:
        if math.isfinite(t) and t > 0:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError, TypeError):
        pass
    return f"? ({t!r:.24})"
