"""``ckpt claim``: an administrator gives a run to a Kubernetes namespace (its ``OWNER.json``).

The operator never claims a run, and a trainer claims only the run it creates (no
checkpoints yet). A **legacy run** — checkpoints but no ``OWNER.json``, written before
owner records existed or by a trainer outside Kubernetes — is therefore left alone by
everyone (no retention, no restart from it; a trainer refuses to resume it) until
someone who knows whose it is runs this command with write access to the storage
(:func:`ckpt_agent.format.owner.admin_claim`). Without ``--run-id`` it lists the runs
of the storage with their owners, legacy ones first.
"""

from __future__ import annotations

import re
import time
from typing import Annotated

import typer
from rich.table import Table

from ckpt_agent.cli.common import (
    ConfigOpt,
    ExitCode,
    StorageOpt,
    console,
    fail,
    guarded,
    load_policy,
    open_store,
    plain,
    safe,
    say,
)
from ckpt_agent.errors import CheckpointFormatError, RunOwnershipError
from ckpt_agent.format.listing import list_checkpoints, list_runs
from ckpt_agent.format.owner import RunOwner, admin_claim, read_owner
from ckpt_agent.persist.housekeeping import who
from ckpt_agent.storage import Storage

__all__ = ["claim"]

#: A Kubernetes namespace name (RFC 1123 label).
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

#: Longest --job (a Kubernetes object name; the record stays far below its 4 KiB cap).
JOB_MAX = 253

#: Runs listed without --run-id, at most.
LIST_MAX = 1000

EPILOG = (
    "Examples: `ckpt claim --storage /mnt/ckpt` lists the runs and their owners; "
    "`ckpt claim --storage /mnt/ckpt --run-id llama-7b --namespace ml-team` claims a legacy "
    "run; add --force to take a run from another namespace (check first that none of its "
    "checkpoints are that namespace's). Exit codes: 0 claimed (or already the namespace's), "
    "1 the run belongs to another namespace (nothing written; --force to replace), "
    "2 bad usage, 3 storage failed, 4 unsafe storage, 5 malformed owner record (--force "
    "replaces it)."
)


def _owner_text(storage: Storage, run_id: str) -> tuple[str, bool]:
    """``(who owns the run, in words; whether it is legacy)``."""
    try:
        owner = read_owner(storage, run_id)
    except CheckpointFormatError as e:
        return f"unreadable OWNER.json ({plain(e, 120)})", False
    if owner is None:
        return "none: legacy run, nobody may use it until claimed", True
    return f"{owner.namespace} (claimed by {owner.claimed_by or '?'})", False


def _list(storage: Storage) -> None:
    runs = list_runs(storage)
    rows = [(run, *_owner_text(storage, run)) for run in runs[:LIST_MAX]]
    table = Table(title=safe(f"runs in {storage.url}"))
    table.add_column("run")
    table.add_column("owner")
    for run, text, _ in sorted(rows, key=lambda r: (not r[2], r[0])):
        table.add_row(safe(run), ("[yellow]" if text.startswith("none") else "") + safe(text))
    console.print(table)
    if len(runs) > LIST_MAX:
        say(f"… and {len(runs) - LIST_MAX} more run(s)")
    legacy = sum(1 for r in rows if r[2])
    say(
        f"{legacy} legacy run(s): claim each with `ckpt claim --run-id RUN --namespace NS`"
        if legacy
        else "no legacy runs"
    )


@guarded
def claim(
    storage: StorageOpt = "",
    run_id: Annotated[
        str,
        typer.Option(
            "--run-id",
            "-r",
            help="The run to claim (its folder under the storage root). Without it: list "
            "the runs and their owners, legacy runs (no owner) first.",
        ),
    ] = "",
    namespace: Annotated[
        str,
        typer.Option(
            "--namespace",
            "-n",
            help="The Kubernetes namespace the run belongs to: its jobs may resume it and "
            "its policies' retention may clean it up.",
        ),
    ] = "",
    job: Annotated[
        str, typer.Option("--job", help="For people reading OWNER.json: the job it is for.")
    ] = "",
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace an owner record naming another namespace (or an unreadable one). "
            "Check first that none of the run's checkpoints are that namespace's.",
        ),
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Give a run to a Kubernetes namespace: write its OWNER.json.

    An administrator's action. A run belongs to the namespace in its
    OWNER.json: only that namespace's jobs resume it and only its policies'
    retention deletes from it. The trainer writes the record when it creates
    a run; the operator never does. A run with checkpoints but no record (a
    legacy run: written before owner records existed, or by a trainer
    outside Kubernetes) may be anyone's, so nobody uses it (the operator
    reports LegacyRunUnclaimed, a trainer refuses to resume it) until you
    claim it here. You need write access to the storage; the command adds
    no privilege.

    Claiming a run that does not exist yet reserves its id for the
    namespace. A run already the namespace's is left as it is.
    """
    store = open_store(storage, load_policy(config))
    if not run_id:
        _list(store)
        return
    if not _NAMESPACE.fullmatch(namespace):
        raise fail(
            f"--namespace {plain(namespace, 80)!r} is not a Kubernetes namespace name "
            "(lowercase letters, digits and '-', at most 63 characters)"
        )
    if len(job) > JOB_MAX:
        raise fail(f"--job is {len(job)} characters long; a job name has at most {JOB_MAX}")
    try:
        checkpoints = list_checkpoints(store, run_id, include_heartbeat=False)
    except ValueError as e:  # not a run id (a format error is a ValueError too: explained)
        if isinstance(e, CheckpointFormatError):
            raise
        raise fail(plain(e)) from None
    owner = RunOwner(namespace, job.strip(), "", f"admin {who()}", time.time())
    try:
        before, now = admin_claim(store, run_id, owner, force=force)
    except CheckpointFormatError as e:
        raise fail(
            f"run {run_id}: its OWNER.json cannot be read ({plain(e)}); nothing was written. "
            "Pass --force to replace it.",
            ExitCode.DATA,
        ) from None
    except RunOwnershipError as e:
        raise fail(f"{plain(e)}; nothing was written", ExitCode.PROBLEM) from None
    held = f"{len(checkpoints)} checkpoint(s)"
    if before is not None and before.namespace == now.namespace:
        say(f"run {safe(run_id)} already belongs to namespace {safe(now.namespace)} ({held})")
    elif before is None:
        kind = "a legacy run" if checkpoints else "no checkpoints yet: its id is reserved"
        say(f"claimed run {safe(run_id)} for namespace {safe(now.namespace)} ({kind}; {held})")
    else:
        say(
            f"run {safe(run_id)} moved from namespace {safe(before.namespace)} to "
            f"{safe(now.namespace)} ({held})"
        )
