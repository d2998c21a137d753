"""``ckpt recover`` / ``ckpt-recover``: plan a recovery, verify it, make the next start use it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ckpt_agent.cli.common import (
    ConfigOpt,
    ExitCode,
    RunOpt,
    StorageOpt,
    console,
    fail,
    guarded,
    load_policy,
    open_store,
    records_of,
    safe,
    say,
)
from ckpt_agent.cli.recover_job import request_recovery
from ckpt_agent.decide.recovery import PlanStep, RecoveryPlan, plan_recovery, walk
from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import recover_request_key
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.housekeeping import append_audit, who
from ckpt_agent.persist.validate import load_check
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.storage import Storage

__all__ = ["recover"]


def _print_plan(plan: RecoveryPlan) -> None:
    table = Table(title=f"recovery plan: {safe(plan.reason)}")
    for col in ("#", "rung", "action", "checkpoint", "weights from", "needs force", "why"):
        table.add_column(col, no_wrap=col in ("checkpoint", "weights from", "action"))
    for i, s in enumerate(plan.steps, 1):
        table.add_row(
            str(i),
            str(s.rung),
            safe(s.action),
            safe(s.checkpoint_id),
            safe(s.weights_from or ""),
            "yes" if s.requires_force else "",
            safe(s.reason),
        )
    console.print(table)
    for cid, why in plan.skipped.items():
        say(f"  [dim]skipped {safe(cid)}: {safe(why)}[/]")


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
        raise fail("--step needs --manual (a named step bypasses the automatic ladder)")
    if manual and step is None:
        raise fail("--manual needs --step N (the global step to resume from)")
    cfg = load_policy(config)
    store = open_store(storage, cfg)
    records = records_of(store, run_id)
    if step is not None and not any(r.step == step for r in records):
        steps = ", ".join(str(s) for s in sorted({r.step for r in records}))
        raise fail(
            f"no checkpoint at step {step} in run {run_id!r} (steps with checkpoints: {steps})"
        )
    plan = plan_recovery(records, cfg.recovery, manual_step=step, force=force)
    _print_plan(plan)
    if plan.empty:
        raise fail(plan.reason, ExitCode.PROBLEM)
    by_id = {r.id: r for r in records}
    verify_fn = _verify_for_recovery(store, run_id, by_id)
    if manual and not force:
        say("[yellow]a manual recovery bypasses the automatic ladder: add --force to apply it[/]")
        if not dry_run:
            raise typer.Exit(ExitCode.PROBLEM)
        forced = plan_recovery(records, cfg.recovery, manual_step=step, force=True)
        would, _ = walk(forced, verify_fn)
        if would is None:
            raise fail(f"even with --force nothing at step {step} verifies", ExitCode.PROBLEM)
        say(f"with --force it would resume from {safe(would.checkpoint_id)} (step {would.step})")
        return
    chosen, rejected = walk(plan, verify_fn)
    for s_, why in rejected:
        if why != "needs force":
            say(f"  [red]rejected {safe(s_.checkpoint_id)}: {safe(why)}[/]")
    if chosen is None:
        raise fail("no step of the plan verified: nothing to recover from", ExitCode.PROBLEM)
    say(
        f"[bold green]would resume from {safe(chosen.checkpoint_id)}[/]"
        + (f" (weights from {safe(chosen.weights_from)})" if chosen.weights_from else "")
        + f": training continues at step {chosen.step + 1}"
    )
    if dry_run:
        say("[dim]--dry-run: nothing written[/]")
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
    say(
        safe(
            f"recorded in {recover_request_key(run_id)}: the next start of run {run_id!r} "
            f"resumes from {chosen.checkpoint_id} "
            f"(or set CKPT_RESUME_FROM={chosen.checkpoint_id}); audit log appended",
            None,
        )
    )


ManualOpt = Annotated[
    bool,
    typer.Option("--manual", help="Resume from a step you name instead of the ladder's choice."),
]
StepOpt = Annotated[
    int | None,
    typer.Option(
        "--step", min=0, help="Global step to resume from (with --manual; `ckpt ls` lists them)."
    ),
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
JobOpt = Annotated[
    str | None,
    typer.Option(
        "--job",
        help="Ask the operator instead (annotates this failed PyTorchJob via kubectl; "
        "works after GaveUp; needs --step and --reason).",
    ),
]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", "-n", help="The job's namespace (with --job).")
]


@guarded
def recover(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    manual: ManualOpt = False,
    step: StepOpt = None,
    dry_run: DryOpt = False,
    force: ForceOpt = False,
    reason: ReasonOpt = "",
    job: JobOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Plan a recovery, verify the choice, and make the next start resume from it.

    Without --manual: the automatic ladder (newest valid weights checkpoint, its
    prev-hash chain, newest full, heartbeat rebuild). With --manual --step N:
    that step's checkpoints, which needs --force. The choice is verified (hashes
    and decoding), written to <run>/RECOVER.json (the trainer's next start()
    loads exactly it, once) and appended to <run>/audit.log with who and when.
    Exit code 1 when nothing verifies (or --manual lacks --force).

    With --job J --step N --reason ...: the operator does it (annotations on the failed
    PyTorchJob; --dry-run reports the plan as an Event, --force lifts the poisoned and
    pending exclusions); the storage is not read here.
    """
    if job:
        request_recovery(job, namespace, step, reason=reason, force=force, dry_run=dry_run)
        return
    _recover(storage, run_id, config, manual, step, dry_run, force, reason)
