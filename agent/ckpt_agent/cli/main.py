"""``ckpt``: look at, verify, recover and clean up a run's checkpoints.

Every command reads storage directly (the manifests are the truth) and never
imports torch or unpickles anything, so it is safe to point at any storage.

.. code-block:: text

    ckpt ls      --storage /mnt/ckpt --run-id llama-7b
    ckpt verify  --storage s3://bucket/ckpt --run-id llama-7b --all
    ckpt recover --manual --step 1200 --dry-run     # show what would be loaded
    ckpt recover --manual --step 1200 --force       # make the next start load it
    ckpt gc      --dry-run
    ckpt sidecar                                    # the pod's persisting sidecar

``--storage`` and ``--run-id`` default to ``CKPT_STORAGE_URL`` and
``CKPT_RUN_ID``; retention and recovery settings come from the policy
config in ``CKPT_CONFIG`` (``--config``), else the defaults. Exit codes: 0
fine, 1 a problem was found (corrupted data, nothing to recover), 2 bad usage
(missing directory, unknown run or step).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import unquote, urlsplit

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ckpt_agent.decide.recovery import PlanStep, RecoveryPlan, plan_recovery, walk
from ckpt_agent.decide.retention import effective_class, plan_retention
from ckpt_agent.format.manifest import (
    CheckpointFormatError,
    list_checkpoints,
    list_runs,
    recover_request_key,
    verify_hashes,
)
from ckpt_agent.persist.housekeeping import (
    DEFAULT_GRACE_S,
    append_audit,
    apply_retention,
    gc_blobs,
    who,
)
from ckpt_agent.persist.validate import load_check
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Tier
from ckpt_agent.storage import Storage, StorageError, open_storage

__all__ = ["app", "main", "recover_app", "recover_main"]

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)

HELP = """Look at, verify, recover and clean up a training run's checkpoints.

Reads storage directly (the manifests are the truth); never imports torch or
unpickles anything.

[b]--storage[/] and [b]--run-id[/] default to [b]CKPT_STORAGE_URL[/] and [b]CKPT_RUN_ID[/];
retention and recovery settings come from [b]CKPT_CONFIG[/] ([b]--config[/]).

Examples:

  ckpt ls --storage /mnt/ckpt --run-id llama-7b

  ckpt verify --all

  ckpt recover --manual --step 1200 --dry-run

  ckpt recover --manual --step 1200 --force --reason "loss spike at 1250"

  ckpt gc --dry-run

Exit codes: 0 fine, 1 a problem was found (corrupted data, nothing to
recover), 2 bad usage (missing directory, unknown run or step).
"""

app = typer.Typer(
    name="ckpt",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

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


# --------------------------------------------------------------------------- helpers


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    return typer.Exit(code)


def _say(message: str) -> None:
    console.print(message, soft_wrap=True)


def _open(url: str) -> Storage:
    if not url:
        raise _fail("no storage given: pass --storage URL or set CKPT_STORAGE_URL")
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        path = Path(unquote(parts.path) if parts.scheme == "file" else url)
        if not path.is_dir():
            raise _fail(
                f"storage directory {path} does not exist (check --storage / CKPT_STORAGE_URL; "
                "the trainer creates it on its first checkpoint)"
            )
    try:
        return open_storage(url)
    except (ValueError, ImportError, StorageError) as e:
        raise _fail(f"cannot open storage {url!r}: {e}") from None


def _config(path: Path | None) -> AgentConfig:
    if path is None:
        return AgentConfig()
    if not path.is_file():
        raise _fail(f"config file {path} does not exist (--config / CKPT_CONFIG)")
    try:
        return AgentConfig.from_json(path.read_text())
    except ValueError as e:
        raise _fail(f"config file {path} is not a valid agent config: {e}") from None


def _records(
    storage: Storage, run_id: str, *, include_heartbeat: bool = True
) -> list[CheckpointRecord]:
    if not run_id:
        raise _fail("no run given: pass --run-id ID or set CKPT_RUN_ID")
    try:
        records = list_checkpoints(storage, run_id, include_heartbeat=include_heartbeat)
    except ValueError as e:
        raise _fail(str(e)) from None
    except StorageError as e:
        raise _fail(f"cannot list {storage.url}: {e}") from None
    if not records:
        runs = list_runs(storage)
        known = ", ".join(runs[:20]) if runs else "none"
        raise _fail(f"run {run_id!r} has no checkpoints in {storage.url} (runs there: {known})")
    return records


def _size(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return str(n)


_STATUS_STYLE = {
    CheckpointStatus.VALID: "green",
    CheckpointStatus.PENDING: "yellow",
    CheckpointStatus.CORRUPTED: "bold red",
    CheckpointStatus.EXPIRED: "dim",
}


def _flags(r: CheckpointRecord) -> str:
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


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""


# --------------------------------------------------------------------------- ls


@app.command("ls")
def ls(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List a run's committed checkpoints: tier, status, retention class, size, flags.

    Only checkpoints whose COMMIT is published are listed; the newest L0
    heartbeat is shown too. Status comes from the validator's verdict
    (pending = not validated yet, never offered for resume).
    """
    cfg = _config(config)
    store = _open(storage)
    records = _records(store, run_id)
    if as_json:
        console.print_json(
            json.dumps(
                [
                    {
                        "id": r.id,
                        "step": r.step,
                        "tier": r.tier.value,
                        "status": r.status.value,
                        "class": effective_class(r, cfg.retention).value,
                        "score": r.score,
                        "size_bytes": r.size_bytes,
                        "created_at": r.created_at,
                        "flags": _flags(r),
                        "manifest_hash": r.manifest_hash,
                        "reason": r.extra.get("status_reason") or r.extra.get("error", ""),
                    }
                    for r in records
                ]
            )
        )
        return
    table = Table(title=f"{run_id} @ {store.url}")
    for col in (
        "checkpoint",
        "step",
        "tier",
        "status",
        "class",
        "score",
        "size",
        "committed",
        "flags",
    ):
        table.add_column(
            col,
            justify="right" if col in ("step", "score", "size") else "left",
            no_wrap=col in ("checkpoint", "status"),
        )
    for r in records:
        status = f"[{_STATUS_STYLE[r.status]}]{r.status.value}[/]"
        table.add_row(
            r.id,
            str(r.step),
            r.tier.value,
            status,
            effective_class(r, cfg.retention).value,
            f"{r.score:.2f}",
            _size(r.size_bytes) if r.tier != Tier.HEARTBEAT else "-",
            _when(r.created_at),
            _flags(r),
        )
    console.print(table)
    bad = [r for r in records if r.status == CheckpointStatus.CORRUPTED]
    for r in bad:
        why = r.extra.get("status_reason") or r.extra.get("error") or ""
        _say(f"[red]{r.id}[/]: {why}")


# --------------------------------------------------------------------------- verify


@app.command("verify")
def verify(
    checkpoints: Annotated[
        list[str] | None,
        typer.Argument(help="Checkpoint ids (default: the newest weights checkpoint)."),
    ] = None,
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    all_: Annotated[bool, typer.Option("--all", help="Verify every committed checkpoint.")] = False,
    hashes_only: Annotated[
        bool, typer.Option("--hashes-only", help="Only re-hash the stored bytes (skip decoding).")
    ] = False,
) -> None:
    """Re-read checkpoints: every blob's size and SHA-256, then decode every tensor.

    Decoding checks the codec, the decoded bytes' SHA-256 and that the state
    tree only references tensors the manifest holds. Nothing is unpickled and
    no torch is imported. Exit code 1 when any checkpoint is damaged.
    """
    store = _open(storage)
    records = [r for r in _records(store, run_id) if r.tier != Tier.HEARTBEAT]
    by_id = {r.id: r for r in records}
    if checkpoints:
        unknown = [c for c in checkpoints if c not in by_id]
        if unknown:
            raise _fail(
                f"no committed checkpoint {', '.join(unknown)} in run {run_id!r} "
                f"(committed: {', '.join(by_id) or 'none'})"
            )
        targets = [by_id[c] for c in checkpoints]
    elif all_:
        targets = records
    else:
        weights = [r for r in records if r.has_weights]
        targets = [max(weights, key=lambda r: r.step)] if weights else []
    results: list[tuple[CheckpointRecord, bool, str, int]] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as progress:
        for r in targets:
            task = progress.add_task(f"hashing {r.id}", total=None)

            def cb(done: int, total: int, task: Any = task) -> None:
                progress.update(task, completed=done, total=total)

            res = verify_hashes(store, run_id, r.id, progress=cb)
            ok, why, nbytes = res.ok, res.reason, res.bytes_checked
            if ok and not hashes_only:
                progress.update(task, description=f"decoding {r.id}")
                for rank in range(r.world_size):
                    rep = load_check(store, run_id, r.id, rank)
                    if not rep.ok:
                        ok, why = False, rep.error
                        break
            results.append((r, ok, why, nbytes))
            progress.remove_task(task)
    table = Table(title=f"verify {run_id}")
    for col in ("checkpoint", "tier", "stored status", "check", "bytes read"):
        table.add_column(col, no_wrap=True)
    for r, ok, _why, nbytes in results:
        table.add_row(
            r.id,
            r.tier.value,
            r.status.value,
            "[green]ok[/]" if ok else "[bold red]CORRUPTED[/]",
            _size(nbytes),
        )
    console.print(table)
    for r, ok, why, _ in results:
        if not ok:
            _say(f"[bold red]CORRUPTED[/] {r.id}: {why}")
    if any(not ok for _, ok, _, _ in results):
        raise typer.Exit(1)


# --------------------------------------------------------------------------- recover


def _print_plan(plan: RecoveryPlan) -> None:
    table = Table(title=f"recovery plan: {plan.reason}")
    for col in ("#", "rung", "action", "checkpoint", "weights from", "needs force", "why"):
        table.add_column(col, no_wrap=col in ("checkpoint", "weights from", "action"))
    for i, s in enumerate(plan.steps, 1):
        table.add_row(
            str(i),
            str(s.rung),
            s.action,
            s.checkpoint_id,
            s.weights_from or "",
            "yes" if s.requires_force else "",
            s.reason,
        )
    console.print(table)
    for cid, why in plan.skipped.items():
        _say(f"  [dim]skipped {cid}: {why}[/]")


def _verify_for_recovery(store: Storage, run_id: str, records: dict[str, CheckpointRecord]) -> Any:
    def verify(cid: str) -> bool:
        rec = records.get(cid)
        if rec is not None and rec.tier == Tier.HEARTBEAT:
            return True
        res = verify_hashes(store, run_id, cid)
        if not res.ok:
            raise CheckpointFormatError(res.reason)
        rep = load_check(store, run_id, cid)
        if not rep.ok:
            raise CheckpointFormatError(rep.error)
        return True

    return verify


def _recover(
    storage: str,
    run_id: str,
    config: Path | None,
    manual: bool,
    step: int | None,
    dry_run: bool,
    force: bool,
    reason: str,
) -> None:
    if step is not None and not manual:
        raise _fail("--step needs --manual (a named step bypasses the automatic ladder)")
    if manual and step is None:
        raise _fail("--manual needs --step N (the global step to resume from)")
    cfg = _config(config)
    store = _open(storage)
    records = _records(store, run_id)
    if step is not None and not any(r.step == step for r in records):
        steps = ", ".join(str(s) for s in sorted({r.step for r in records}))
        raise _fail(
            f"no checkpoint at step {step} in run {run_id!r} (steps with checkpoints: {steps})"
        )
    plan = plan_recovery(records, cfg.recovery, manual_step=step, force=force)
    _print_plan(plan)
    if plan.empty:
        raise _fail(plan.reason, 1)
    by_id = {r.id: r for r in records}
    verify_fn = _verify_for_recovery(store, run_id, by_id)
    if manual and not force:
        _say("[yellow]a manual recovery bypasses the automatic ladder: add --force to apply it[/]")
        if not dry_run:
            raise typer.Exit(1)
        forced = plan_recovery(records, cfg.recovery, manual_step=step, force=True)
        would, _ = walk(forced, verify_fn)
        if would is None:
            raise _fail(f"even with --force nothing at step {step} verifies", 1)
        _say(f"with --force it would resume from {would.checkpoint_id} (step {would.step})")
        return
    chosen, rejected = walk(plan, verify_fn)
    for s_, why in rejected:
        if why != "needs force":
            _say(f"  [red]rejected {s_.checkpoint_id}: {why}[/]")
    if chosen is None:
        raise _fail("no step of the plan verified: nothing to recover from", 1)
    _say(
        f"[bold green]would resume from {chosen.checkpoint_id}[/]"
        + (f" (weights from {chosen.weights_from})" if chosen.weights_from else "")
        + f": training continues at step {chosen.step + 1}"
    )
    if dry_run:
        _say("[dim]--dry-run: nothing written[/]")
        return
    _apply_recovery(store, run_id, chosen, force=force, manual=manual, reason=reason)


def _apply_recovery(
    store: Storage, run_id: str, chosen: PlanStep, *, force: bool, manual: bool, reason: str
) -> None:
    request = {
        "checkpoint_id": chosen.checkpoint_id,
        "weights_from": chosen.weights_from,
        "action": chosen.action,
        "step": chosen.step,
        "force": force,
        "manual": manual,
        "requested_by": who(),
        "requested_at": time.time(),
        "reason": reason,
    }
    store.commit(recover_request_key(run_id), json.dumps(request, sort_keys=True).encode())
    append_audit(
        store,
        run_id,
        {
            "time": time.time(),
            "who": request["requested_by"],
            "what": "manual recovery requested" if manual else "recovery requested",
            "checkpoint": chosen.checkpoint_id,
            "weights_from": chosen.weights_from,
            "force": force,
            "reason": reason,
        },
    )
    _say(
        f"recorded in {recover_request_key(run_id)}: the next start of run {run_id!r} resumes from "
        f"{chosen.checkpoint_id} (or set CKPT_RESUME_FROM={chosen.checkpoint_id}); "
        "audit log appended"
    )


ManualOpt = Annotated[
    bool,
    typer.Option("--manual", help="Resume from a step you name instead of the ladder's choice."),
]
StepOpt = Annotated[
    int | None, typer.Option("--step", help="Global step to resume from (with --manual).")
]
DryOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print the plan and the choice; write nothing.")
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Allow a low-score, pending, poisoned or older checkpoint (never a corrupted one).",
    ),
]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why (kept in the audit log).")]


@app.command("recover")
def recover(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    manual: ManualOpt = False,
    step: StepOpt = None,
    dry_run: DryOpt = False,
    force: ForceOpt = False,
    reason: ReasonOpt = "",
) -> None:
    """Plan a recovery, verify the choice, and make the next start resume from it.

    Without --manual: the automatic ladder (newest valid weights checkpoint, its
    prev-hash chain, newest full, heartbeat rebuild). With --manual --step N:
    that step's checkpoints, which needs --force. The choice is verified (hashes
    and decoding), written to <run>/RECOVER.json (the trainer's next start()
    loads exactly it, once) and appended to <run>/audit.log with who and when.
    """
    _recover(storage, run_id, config, manual, step, dry_run, force, reason)


# --------------------------------------------------------------------------- gc


@app.command("gc")
def gc(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be deleted.")] = False,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            help="Seconds: unreferenced blobs younger than this are kept (a writer may be "
            "about to commit them).",
        ),
    ] = DEFAULT_GRACE_S,
) -> None:
    """Apply the retention policy, then delete blobs no manifest references.

    Retention keeps the newest valid checkpoint of each tier, critical ones,
    last-known-good ones before unresolved anomalies and pending ones; then the
    newest N of each class. Deleting removes the COMMIT first.
    """
    cfg = _config(config)
    store = _open(storage)
    records = _records(store, run_id, include_heartbeat=False)
    plan = plan_retention(records, cfg.retention, (), time.time())
    table = Table(title=f"retention for {run_id}" + (" (dry run)" if dry_run else ""))
    for col in ("checkpoint", "status", "class", "size", "decision", "why"):
        table.add_column(col)
    for r in sorted(records, key=lambda r: r.step):
        keep = r.id in plan.keep
        table.add_row(
            r.id,
            r.status.value,
            effective_class(r, cfg.retention).value,
            _size(r.size_bytes),
            "[green]keep[/]" if keep else "[red]delete[/]",
            plan.keep.get(r.id) or plan.delete.get(r.id, ""),
        )
    console.print(table)
    deleted = apply_retention(store, run_id, plan, dry_run=dry_run)
    res = gc_blobs(store, run_id, grace_s=grace, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    _say(
        f"{verb} {len(deleted)} checkpoint(s) and {len(res.deleted)} unreferenced blob(s) "
        f"({_size(res.freed_bytes)}); {len(res.stale_folders)} stale uncommitted folder(s); "
        f"{res.kept_young} blob(s) younger than {grace:g} s kept"
    )
    for w in plan.warnings:
        _say(f"[yellow]warning:[/] {w}")


# --------------------------------------------------------------------------- sidecar


@app.command(
    "sidecar",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def sidecar(ctx: typer.Context) -> None:
    """Persist a run's shared-memory snapshots (the pod's sidecar; flash checkpoints).

    Reads the same environment as the trainer (CKPT_CONFIG, CKPT_SHM_DIR,
    CKPT_STORAGE_URL, CKPT_RUN_ID, CKPT_METRICS_PORT …); [b]ckpt sidecar --help[/]
    lists its flags. Serves /metrics, /healthz and /readyz; SIGTERM persists
    what is pending and exits within the grace period (CKPT_GRACE_S).
    """
    from ckpt_agent.flash.sidecar import main as sidecar_main

    raise typer.Exit(sidecar_main(list(ctx.args)))


# --------------------------------------------------------------------------- entry points

recover_app = typer.Typer(
    name="ckpt-recover",
    help="Manual recovery: " + (recover.__doc__ or ""),
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
recover_app.command()(recover)


def main(argv: Sequence[str] | None = None) -> None:
    """``ckpt`` console script."""
    app(args=list(argv) if argv is not None else None, prog_name="ckpt")


def recover_main(argv: Sequence[str] | None = None) -> None:
    """``ckpt-recover`` console script (the manual recovery path)."""
    recover_app(args=list(argv) if argv is not None else None, prog_name="ckpt-recover")


if __name__ == "__main__":
    main()
