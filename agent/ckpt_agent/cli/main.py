"""``ckpt``: look at, verify, recover and clean up a run's checkpoints.

Every command reads storage directly (the manifests are the truth) and never
imports torch or unpickles anything, so it is safe to point at any storage.

.. code-block:: text

    ckpt ls      --storage /mnt/ckpt --run-id llama-7b
    ckpt verify  --storage s3://bucket/ckpt --run-id llama-7b --all
    ckpt recover --manual --step 1200 --dry-run     # show what would be loaded
    ckpt recover --manual --step 1200 --force       # make the next start load it
    ckpt recover --job train --step 1200 --reason "loss spike"  # the operator restarts it
    ckpt gc      --dry-run
    ckpt sidecar                                    # the pod's persisting sidecar

``--storage`` and ``--run-id`` default to ``CKPT_STORAGE_URL`` and
``CKPT_RUN_ID``; retention and recovery settings, and the S3 options (applied
over ``CKPT_S3_*``), come from the agent config in ``CKPT_CONFIG``
(``--config``), else the defaults. Exit codes:
:class:`~ckpt_agent.cli.common.ExitCode` (0 fine, 1 a problem was found, 2 bad
usage, 3 storage failed, 4 unsafe storage, 5 malformed data, 70 a bug). Every
command is :func:`~ckpt_agent.cli.common.guarded` and shows stored strings only
through :func:`~ckpt_agent.cli.common.safe`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ckpt_agent.cli.claim import EPILOG as CLAIM_EPILOG
from ckpt_agent.cli.claim import claim
from ckpt_agent.cli.common import (
    EXIT_CODES_HELP,
    ConfigOpt,
    ExitCode,
    RunOpt,
    StorageOpt,
    console,
    err,
    fail,
    guarded,
    human_size,
    load_policy,
    non_negative,
    open_store,
    plain,
    records_of,
    safe,
    say,
)
from ckpt_agent.cli.ls import ls
from ckpt_agent.cli.recover import recover
from ckpt_agent.cli.report import report
from ckpt_agent.cli.sidecar import sidecar
from ckpt_agent.cli.simulate import simulate
from ckpt_agent.decide.retention import effective_class, plan_retention
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.housekeeping import (
    apply_retention,
    gc_blobs,
)
from ckpt_agent.persist.validate import load_check
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.tuning import GC_GRACE_S

__all__ = ["app", "main", "recover_app", "recover_main"]

HELP = f"""Look at, verify, recover, clean up and report on a training run's checkpoints.

Reads storage directly (the manifests are the truth); never imports torch or
unpickles anything, and shows what it read as plain text (markup and terminal
escape sequences in stored strings are escaped).

[b]--storage[/] and [b]--run-id[/] default to [b]CKPT_STORAGE_URL[/] and [b]CKPT_RUN_ID[/];
retention and recovery settings, and the S3 options, come from [b]CKPT_CONFIG[/] ([b]--config[/]).

Examples:

  ckpt ls --storage /mnt/ckpt --run-id llama-7b

  ckpt verify --all

  ckpt recover --manual --step 1200 --dry-run

  ckpt recover --manual --step 1200 --force --reason "loss spike at 1250"

  ckpt recover --job train -n ml --step 1200 --reason "loss spike at 1250"

  ckpt gc --dry-run

  ckpt report --storage /mnt/ckpt --run-id llama-7b --work-dir /var/run/ckpt/work

  ckpt simulate --mtbf 3600

{EXIT_CODES_HELP}
"""

app = typer.Typer(
    name="ckpt",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


app.command("ls", epilog=EXIT_CODES_HELP)(ls)  # cli/ls.py


# --------------------------------------------------------------------------- verify


@app.command("verify", epilog=EXIT_CODES_HELP)
@guarded
def verify(
    checkpoints: Annotated[
        list[str] | None,
        typer.Argument(help="Checkpoint ids (default: the newest weights checkpoint)."),
    ] = None,
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
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
    store = open_store(storage, load_policy(config))
    records = [r for r in records_of(store, run_id) if r.tier != Tier.HEARTBEAT]
    by_id = {r.id: r for r in records}
    if checkpoints:
        unknown = [c for c in checkpoints if c not in by_id]
        if unknown:
            raise fail(
                f"no committed checkpoint {', '.join(unknown)} in run {run_id!r} "
                f"(committed: {', '.join(by_id) or 'none'}; see `ckpt ls`)"
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
            task = progress.add_task(f"hashing {safe(r.id)}", total=None)

            def cb(done: int, total: int, task: Any = task) -> None:
                progress.update(task, completed=done, total=total)

            res = verify_hashes(store, run_id, r.id, progress=cb)
            ok, why, nbytes = res.ok, res.reason, res.bytes_checked
            if ok and not hashes_only:
                progress.update(task, description=f"decoding {safe(r.id)}")
                for rank in range(r.world_size):
                    rep = load_check(store, run_id, r.id, rank)
                    if not rep.ok:
                        ok, why = False, rep.error
                        break
            results.append((r, ok, why, nbytes))
            progress.remove_task(task)
    table = Table(title=safe(f"verify {run_id}"))
    for col in ("checkpoint", "tier", "stored status", "check", "bytes read"):
        table.add_column(col, no_wrap=True)
    for r, ok, _why, nbytes in results:
        table.add_row(
            safe(r.id),
            r.tier.value,
            r.status.value,
            "[green]ok[/]" if ok else "[bold red]CORRUPTED[/]",
            human_size(nbytes),
        )
    console.print(table)
    for r, ok, why, _ in results:
        if not ok:
            say(f"[bold red]CORRUPTED[/] {safe(r.id)}: {safe(why)}")
    if any(not ok for _, ok, _, _ in results):
        raise typer.Exit(ExitCode.PROBLEM)


app.command("recover", epilog=EXIT_CODES_HELP)(recover)


# --------------------------------------------------------------------------- gc


@app.command("gc", epilog=EXIT_CODES_HELP)
@guarded
def gc(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be deleted.")] = False,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            callback=non_negative,
            help="Seconds (finite, >= 0): unreferenced blobs and uncommitted folders younger "
            "than this are kept (a writer may be about to commit them). 0 only when no "
            "trainer is writing.",
        ),
    ] = GC_GRACE_S,
) -> None:
    """Apply the retention policy, then delete blobs no manifest references.

    Retention keeps the newest valid checkpoint of each tier, critical ones,
    last-known-good ones before unresolved anomalies and pending ones; then the
    newest N of each class. Deleting removes the COMMIT first. Blob collection
    is skipped (exit code 1) while any rank manifest of the run is unreadable:
    it might reference any blob.
    """
    cfg = load_policy(config)
    store = open_store(storage, cfg)
    records = records_of(store, run_id, include_heartbeat=False)
    plan = plan_retention(records, cfg.retention, (), time.time())
    table = Table(title=safe(f"retention for {run_id}") + (" (dry run)" if dry_run else ""))
    for col in ("checkpoint", "status", "class", "size", "decision", "why"):
        table.add_column(col)
    for r in sorted(records, key=lambda r: r.step):
        keep = r.id in plan.keep
        table.add_row(
            safe(r.id),
            r.status.value,
            effective_class(r, cfg.retention).value,
            human_size(r.size_bytes),
            "[green]keep[/]" if keep else "[red]delete[/]",
            safe(plan.keep.get(r.id) or plan.delete.get(r.id, "")),
        )
    console.print(table)
    deleted = apply_retention(store, run_id, plan, dry_run=dry_run)
    res = gc_blobs(store, run_id, grace_s=grace, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    say(
        f"{verb} {len(deleted)} checkpoint(s) and {len(res.deleted)} unreferenced blob(s) "
        f"({human_size(res.freed_bytes)}); {len(res.stale_folders)} stale uncommitted folder(s); "
        f"{res.kept_young} blob(s) younger than {grace:g} s kept"
    )
    for w in plan.warnings:
        say(f"[yellow]warning:[/] {safe(w)}")
    if res.unreadable_manifests:
        bad = "; ".join(plain(m, 200) for m in res.unreadable_manifests[:3])
        raise fail(
            f"blob collection skipped: {len(res.unreadable_manifests)} rank manifest(s) cannot "
            f"be read and might reference any blob ({bad}). Run `ckpt verify --all`, delete "
            "or repair those checkpoints, then run `ckpt gc` again.",
            ExitCode.PROBLEM,
        )


# --------------------------------------------------------------------------- sidecar


app.command("sidecar", epilog=EXIT_CODES_HELP)(sidecar)
app.command("simulate")(simulate)
app.command("report", epilog=EXIT_CODES_HELP)(report)
app.command("claim", epilog=CLAIM_EPILOG)(claim)


# --------------------------------------------------------------------------- entry points

recover_app = typer.Typer(
    name="ckpt-recover",
    help=f"Manual recovery: {recover.__doc__ or ''}\n\n{EXIT_CODES_HELP}",
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
recover_app.command(epilog=EXIT_CODES_HELP)(recover)


def main(argv: Sequence[str] | None = None) -> None:
    """``ckpt`` console script."""
    app(args=list(argv) if argv is not None else None, prog_name="ckpt")


def recover_main(argv: Sequence[str] | None = None) -> None:
    """``ckpt-recover`` console script (the manual recovery path)."""
    recover_app(args=list(argv) if argv is not None else None, prog_name="ckpt-recover")


if __name__ == "__main__":
    main()
