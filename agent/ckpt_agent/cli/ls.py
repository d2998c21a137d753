"""``ckpt ls``: a run's committed checkpoints as a table (or JSON).

Up to :data:`RICH_ROWS_MAX` checkpoints a rich table with every corrupted checkpoint's
reason under it; more (a run full of garbage: 50,000 unreadable COMMITs) as plain aligned
text and the first :data:`REASONS_SHOWN` reasons with a count of the rest — rendering a
rich table costs ~2.5 ms a row (a 50,000-row one took minutes, issue #28), plain lines
almost nothing. ``--json`` lists everything, every reason, whatever the size.

Under the table, one line says who holds the run: the highest writer generation
(:mod:`ckpt_agent.format.fence`), its pod and node and since when (:func:`holder_line`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.table import Table

from ckpt_agent.cli.common import (
    STATUS_STYLE,
    ConfigOpt,
    RunOpt,
    StorageOpt,
    console,
    flags_of,
    guarded,
    human_size,
    load_policy,
    open_store,
    plain,
    records_of,
    safe,
    say,
    when,
)
from ckpt_agent.decide.retention import effective_class
from ckpt_agent.errors import CheckpointFormatError, NotFoundError
from ckpt_agent.format.fence import generations, read_writer
from ckpt_agent.policy.models import RetentionSpec, Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage.base import Storage

__all__ = ["REASONS_SHOWN", "RICH_ROWS_MAX", "holder_line", "ls"]

RICH_ROWS_MAX = 1000
"""Checkpoints shown in a rich table; more are printed as plain aligned text."""
REASONS_SHOWN = 20
"""Corrupted checkpoints' reasons printed under a plain listing (``--json`` has all)."""

COLUMNS = ("checkpoint", "step", "tier", "status", "class", "score", "size", "committed", "flags")
RIGHT = frozenset(("step", "score", "size"))


def _finite(x: float) -> float | None:
    """A stored number for JSON: ``nan``/``inf`` (not JSON) become null."""
    return x if isinstance(x, int) or math.isfinite(x) else None


def _reason(r: CheckpointRecord) -> str:
    return str(r.extra.get("status_reason") or r.extra.get("error") or "")


def _cells(r: CheckpointRecord, spec: RetentionSpec) -> list[str]:
    """One row's cells as plain text (stored strings cleaned of control characters)."""
    return [
        plain(r.id),
        str(r.step),
        r.tier.value,
        r.status.value,
        effective_class(r, spec).value,
        f"{r.score:.2f}",
        human_size(r.size_bytes) if r.tier != Tier.HEARTBEAT else "-",
        when(r.created_at),
        plain(flags_of(r)),
    ]


def plain_table(records: Sequence[CheckpointRecord], spec: RetentionSpec) -> list[str]:
    """The listing as aligned plain-text lines: a header, then one line per checkpoint."""
    rows = [list(COLUMNS), *(_cells(r, spec) for r in records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return [
        "  ".join(
            cell.rjust(w) if col in RIGHT else cell.ljust(w)
            for col, cell, w in zip(COLUMNS, row, widths, strict=True)
        ).rstrip()
        for row in rows
    ]


def holder_line(store: Storage, run_id: str) -> str:
    """Who holds the run, as one line of plain text (stored names cleaned): the highest
    writer generation, its pod, node and claim time."""
    gens = generations(store, run_id)
    if not gens:
        return "writer: none has claimed this run (no writers/ generation)"
    try:
        rec = read_writer(store, run_id, gens[-1])
    except (NotFoundError, CheckpointFormatError) as e:
        return plain(f"writer: generation {gens[-1]} holds the run (its record is unreadable: {e})")
    where = f"pod {rec.pod or '?'}" + (f" on node {rec.node}" if rec.node else "")
    since = when(rec.time) or "?"
    return plain(f"writer: generation {rec.generation} holds the run: {where}, since {since}")


@guarded
def ls(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (stored strings verbatim) for scripts.")
    ] = False,
) -> None:
    """List a run's committed checkpoints: tier, status, retention class, size, flags.

    Only checkpoints whose COMMIT is published are listed; the newest L0
    heartbeat is shown too. Status comes from the validator's verdict
    (pending = not validated yet, never offered for resume); a corrupted
    checkpoint's reason is printed under the table (over 1000 checkpoints: plain text,
    the first 20 reasons; --json lists all), with the writer that holds the run
    (generation, pod, node, since when).
    """
    cfg = load_policy(config)
    store = open_store(storage, cfg)
    records = records_of(store, run_id)
    if as_json:
        rows = [
            {
                "id": r.id,
                "step": r.step,
                "tier": r.tier.value,
                "status": r.status.value,
                "class": effective_class(r, cfg.retention).value,
                "score": _finite(r.score),
                "size_bytes": r.size_bytes,
                "created_at": _finite(r.created_at),
                "flags": flags_of(r),
                "manifest_hash": r.manifest_hash,
                "reason": _reason(r),
            }
            for r in records
        ]
        typer.echo(json.dumps(rows, indent=2, allow_nan=False))
        return
    corrupted = [r for r in records if r.status == CheckpointStatus.CORRUPTED]
    if len(records) > RICH_ROWS_MAX:
        lines = [plain(f"{run_id} @ {store.url}"), *plain_table(records, cfg.retention)]
        lines.append(holder_line(store, run_id))
        lines += [f"{plain(r.id)}: {plain(_reason(r))}" for r in corrupted[:REASONS_SHOWN]]
        if len(corrupted) > REASONS_SHOWN:
            lines.append(
                f"... and {len(corrupted) - REASONS_SHOWN} more corrupted checkpoint(s) "
                "(ckpt ls --json lists every reason; ckpt gc deletes them)"
            )
        typer.echo("\n".join(lines))
        return
    table = Table(title=safe(f"{run_id} @ {store.url}"))
    for col in COLUMNS:
        table.add_column(
            col,
            justify="right" if col in RIGHT else "left",
            no_wrap=col in ("checkpoint", "status"),
        )
    for r in records:
        table.add_row(
            safe(r.id),
            str(r.step),
            r.tier.value,
            f"[{STATUS_STYLE[r.status]}]{r.status.value}[/]",
            effective_class(r, cfg.retention).value,
            f"{r.score:.2f}",
            human_size(r.size_bytes) if r.tier != Tier.HEARTBEAT else "-",
            when(r.created_at),
            safe(flags_of(r)),
        )
    console.print(table)
    say(safe(holder_line(store, run_id)))
    for r in corrupted:
        say(f"[red]{safe(r.id)}[/]: {safe(_reason(r))}")
