"""Turn a run's data into the numbers of its report (pure: no I/O, JSON-able output).

Definitions (also in ``docs/observability.md``):

* **IO share of wall time**: seconds the training thread stalled for snapshots
  (``snapshot.stall_s``) over the wall time the decision log spans.
* **Recovery success rate**: starts that resumed (or started fresh with nothing
  to resume) over all starts, failed starts (``resume_failed``) included.
* **Ladder rung** of a resume: 1 + the number of newer candidates the recovery
  ladder rejected before the one it loaded.
* **Health score** (0-100): 100 × valid verdicts / verdicts × recovery success
  rate × (1 − IO share). Verdicts and starts absent count as perfect.
* **Bytes vs a full save**: new bytes a checkpoint wrote against the bytes it
  references in all (new + de-duplicated): what a save without reuse would write
  (de-duplication at work); **raw bytes**: the tensors' uncompressed size, against
  which the full save's stored bytes show compression at work. A size the logs do
  not give is ``None`` ("n/a"), never 0.
* **Preemptions**: the Kueue evictions the run went through (save-now signals whose
  request id says ``Preemption``, and the SIGTERM saves that followed them), each with
  its step saved and the steps lost on the resume that followed
  (:mod:`ckpt_agent.report.preemptions`).
* **Saves** come from the trainer's ``committed`` events (in-process persister) or
  from committed ``persisted`` events (shared-memory mode: the trainer's and the
  persister's ``sidecar.jsonl``), joined with the snapshot's stall by step and tier
  and with the stored record.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ckpt_agent.format.layout import parse_checkpoint_id
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.report.preemptions import preemption_totals, preemptions

__all__ = [
    "LOW_HEALTH",
    "MAX_POINTS",
    "SIDECAR_SOURCE",
    "fleet_summary",
    "run_summary",
    "traits_of",
]

#: ``source`` of the events read from the persister's log (``report.data.SIDECAR_GLOB``).
SIDECAR_SOURCE = "sidecar"

#: Runs whose health score is under this are "low" in ``ckpt report --all``.
LOW_HEALTH = 80.0
#: Most points of a per-step series kept in a report (longer series are thinned evenly).
MAX_POINTS = 4000
#: IO share over which a run has the "IO-bound" trait.
IO_HEAVY = 0.05
#: The persister-log (``sidecar.jsonl``) events a report reads; its others (its own
#: start, stop, trainer_up ...) are the persister's, not the run's.
SIDECAR_EVENTS = frozenset({"persisted", "persist_failed", "validated", "retention", "corrupted"})


def _num(v: Any) -> float | None:
    """A finite number from the log, else None (strings, bools, nan, inf)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _str(v: Any, limit: int = 300) -> str:
    return v[:limit] if isinstance(v, str) else ""


def _dict(v: Any) -> dict[Any, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _thin(rows: list[Any], n: int = MAX_POINTS) -> list[Any]:
    if len(rows) <= n:
        return rows
    stride = len(rows) / n
    return [rows[int(i * stride)] for i in range(n)] + [rows[-1]]


def _from_sidecar(e: dict[str, Any]) -> bool:
    return e.get("source") == SIDECAR_SOURCE


def _by_event(events: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        name = str(e.get("event"))
        if not _from_sidecar(e) or name in SIDECAR_EVENTS:
            out.setdefault(name, []).append(e)
    return out


def _int(v: Any) -> int | None:
    n = _num(v)
    return None if n is None else int(n)


def _tier_of(e: dict[str, Any]) -> str:
    """The event's tier, else the one its checkpoint id names (the trainer's
    ``persisted`` event has none)."""
    if tier := _str(e.get("tier"), 40):
        return tier
    try:
        return parse_checkpoint_id(_str(e.get("checkpoint")))[0].value
    except ValueError:
        return ""


def _series(decisions: list[dict[str, Any]]) -> dict[str, list[Any]]:
    loss, score, interval, rules = [], [], [], []
    last_rule: tuple[Any, ...] | None = None
    for d in decisions:
        step = _num(d.get("step"))
        if step is None:
            continue
        s = int(step)
        if (lv := _num(d.get("loss"))) is not None:
            loss.append([s, lv])
        comps = _dict(d.get("components"))
        parts = {str(k)[:40]: v for k, v0 in comps.items() if (v := _num(v0)) is not None}
        if (sc := _num(d.get("score"))) is not None:
            score.append([s, sc, parts])
        iv = _num(d.get("interval"))
        if iv is not None:
            rule = _str(d.get("interval_rule"), 80)
            interval.append([s, int(iv), rule])
            if last_rule is None or (int(iv), rule) != last_rule[1:]:
                rules.append({"step": s, "interval": int(iv), "rule": rule})
                last_rule = (s, int(iv), rule)
    return {
        "loss": _thin(loss),
        "score": _thin(score),
        "interval": _thin(interval),
        "interval_changes": rules[-200:],
    }


def _commits(ev: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The events that say a checkpoint was committed, rank 0's first (its byte counts
    cover every rank; another rank's ``committed`` event counts its own part only)."""
    found = ev.get("committed", []) + [e for e in ev.get("persisted", []) if e.get("committed")]
    return sorted(found, key=lambda e: _num(e.get("rank")) not in (None, 0))


def _save_row(cid: str, step: int, tier: str, time: float | None) -> dict[str, Any]:
    return {
        "checkpoint": cid,
        "step": step,
        "tier": tier,
        "time": time,
        "stall_s": None,
        "persist_s": None,
        "bytes_written": None,
        "bytes_full": None,
        "bytes_raw": None,
        "status": "pending",
        "validation_s": None,
        "reason": "",
        "stored": False,
    }


def _fill(row: dict[str, Any], key: str, value: Any) -> None:
    """Set ``row[key]`` unless an earlier (preferred) event set it."""
    if row[key] is None and value is not None:
        row[key] = value


def _saves(
    ev: dict[str, list[dict[str, Any]]], records: Sequence[CheckpointRecord]
) -> list[dict[str, Any]]:
    """One row per committed checkpoint: log events joined with the stored record."""
    rows: dict[str, dict[str, Any]] = {}
    stalls: dict[tuple[int, str], float] = {}
    for e in ev.get("snapshot", []):  # the slowest rank's stall is the step's
        step, stall = _num(e.get("step")), _num(e.get("stall_s"))
        if step is not None and stall is not None:
            key = (int(step), _str(e.get("tier"), 40))
            stalls[key] = max(stall, stalls.get(key, 0.0))
    for e in _commits(ev):
        cid = _str(e.get("checkpoint"))
        step = _num(e.get("step"))
        if not cid or step is None:
            continue
        tier = _tier_of(e)
        row = rows.setdefault(cid, _save_row(cid, int(step), tier, _num(e.get("time"))))
        _fill(row, "stall_s", stalls.get((int(step), tier)))
        _fill(row, "persist_s", _num(e.get("persist_s", e.get("seconds"))))
        new, reused = _int(e.get("bytes_new")), _int(e.get("bytes_reused"))
        _fill(row, "bytes_written", new)
        _fill(row, "bytes_full", None if new is None or reused is None else new + reused)
        _fill(row, "bytes_raw", _int(e.get("raw_bytes")))
    for e in ev.get("validated", []):
        if (hit := rows.get(_str(e.get("checkpoint")))) is not None:
            hit["status"] = _str(e.get("status"), 40) or "pending"
            hit["validation_s"] = _num(e.get("seconds"))
            hit["reason"] = _str(e.get("reason"))
    for e in ev.get("corrupted", []):  # found corrupted later (by a resume)
        if (hit := rows.get(_str(e.get("checkpoint")))) is not None:
            hit["status"], hit["reason"] = "corrupted", _str(e.get("reason"))
    for r in records:
        row = rows.setdefault(r.id, _save_row(r.id, r.step, r.tier.value, r.created_at))
        _fill(row, "bytes_written", r.size_bytes or None)  # new blobs + manifests
        row["stored"] = True
        row["status"] = r.status.value  # the stored verdict is the truth
        row["score"] = _num(r.score)
        row["reason"] = row["reason"] or _str(r.extra.get("status_reason") or "")
    return sorted(rows.values(), key=lambda r: (r["step"], r["tier"]))


def _before(events: Sequence[dict[str, Any]], rank: Any, time: float | None) -> dict[str, Any]:
    """The newest of ``events`` of ``rank`` at or before ``time`` ({}: none)."""
    found: dict[str, Any] = {}
    for e in events:
        t = _num(e.get("time"))
        if e.get("rank") == rank and t is not None and (time is None or t <= time):
            found = e
    return found


def _source(ev: dict[str, list[dict[str, Any]]], start: dict[str, Any]) -> str:
    """Where a start's state came from: this node's memory, a peer's replica (rehydrated
    first), or storage (with the in-place restart's reason when it was tried)."""
    rank, time = start.get("rank"), _num(start.get("time"))
    inplace = _before(ev.get("inplace_restore", []), rank, time)
    if not inplace:
        return ""
    if inplace.get("outcome") != "memory":
        return _str(f"storage: {inplace.get('reason', '')}")
    asked = _before(ev.get("rehydrate", []), rank, time)
    if asked.get("found"):
        return _str(f"peer replica from {asked.get('source')} (step {asked.get('step')})")
    return "shared memory (in place)"


def _restarts(ev: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for e in ev.get("start", []):
        rejected = _list(e.get("rejected"))
        action = _str(e.get("action"), 40)
        out.append(
            {
                "time": _num(e.get("time")),
                "action": action,
                "source": _source(ev, e),
                "checkpoint": _str(e.get("checkpoint")) or None,
                "next_step": _num(e.get("next_step")),
                "rung": len(rejected) + 1 if e.get("checkpoint") else None,
                "rejected": [str(r)[:300] for r in rejected[:20]],
                "reason": _str(e.get("reason")),
                "seconds": _num(e.get("seconds")),
                "ok": True,
            }
        )
    for e in ev.get("resume_failed", []):
        out.append(
            {
                "time": _num(e.get("time")),
                "action": "failed",
                "source": "",
                "checkpoint": None,
                "next_step": None,
                "rung": None,
                "rejected": [],
                "reason": _str(e.get("error")),
                "seconds": None,
                "ok": False,
            }
        )
    return sorted(out, key=lambda r: r["time"] or 0.0)


def _retention(ev: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for e in ev.get("retention", []):
        deleted = _dict(e.get("deleted"))
        out.append(
            {
                "time": _num(e.get("time")),
                "deleted": {str(k)[:200]: _str(v) for k, v in list(deleted.items())[:200]},
                "blobs_deleted": _num(e.get("blobs_deleted")),
                "bytes_freed": _num(e.get("bytes_freed")),
            }
        )
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _total(saves: Sequence[dict[str, Any]], key: str) -> int | None:
    known = [s[key] for s in saves if s[key] is not None]
    return sum(known) if known else None


def _share(saves: Sequence[dict[str, Any]], part: str, whole: str) -> float | None:
    """``part`` over ``whole`` summed over the saves that know both (None: none does)."""
    both = [s for s in saves if s[part] is not None and s[whole] is not None]
    return _ratio(sum(s[part] for s in both), sum(s[whole] for s in both))


def _byte_totals(saves: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Bytes written, full and raw over the saves (None when no save knows them), and
    de-duplication (written of full) and compression (stored full of raw) shares."""
    return {
        "bytes_written": _total(saves, "bytes_written"),
        "bytes_full": _total(saves, "bytes_full"),
        "bytes_raw": _total(saves, "bytes_raw"),
        "dedup_share": _share(saves, "bytes_written", "bytes_full"),
        "compression_share": _share(saves, "bytes_full", "bytes_raw"),
    }


def run_summary(
    run_id: str,
    records: Sequence[CheckpointRecord],
    events: Sequence[dict[str, Any]],
    audit: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The report of one run as a JSON-able dict (``ckpt report --json``)."""
    ev = _by_event(events)
    series = _series(ev.get("decision", []))
    saves = _saves(ev, records)
    restarts = _restarts(ev)
    # the run's wall time is the trainer's (a persister may start earlier or outlive it)
    own = [e for e in events if not _from_sidecar(e)] or events
    times = [t for e in own if (t := _num(e.get("time"))) is not None]
    wall = max(times) - min(times) if len(times) > 1 else 0.0
    stall = sum(_num(e.get("stall_s")) or 0.0 for e in ev.get("snapshot", []))
    persist = sum(s["persist_s"] or 0.0 for s in saves)
    verdicts = Counter(s["status"] for s in saves)
    judged = verdicts["valid"] + verdicts["corrupted"]
    ok_starts = sum(1 for r in restarts if r["ok"])
    recovery_rate = _ratio(ok_starts, len(restarts))
    io_share = _ratio(stall, wall)
    valid_rate = _ratio(verdicts["valid"], judged)
    health = 100.0 * (valid_rate if valid_rate is not None else 1.0)
    health *= recovery_rate if recovery_rate is not None else 1.0
    health *= 1.0 - min(io_share or 0.0, 1.0)
    scores = [row[1] for row in series["score"]]
    rec_times = [r["seconds"] for r in restarts if r["ok"] and r["seconds"] is not None]
    anomalies = [
        {"step": d.get("step"), "kind": _str(d.get("anomaly"), 80)}
        for d in ev.get("decision", [])
        if d.get("anomaly")
    ]
    return {
        "run_id": run_id,
        "wall_s": wall,
        "health": round(health, 2),
        "mean_score": sum(scores) / len(scores) if scores else None,
        "io_share": io_share,
        "stall_s": stall,
        "persist_s": persist,
        "persist_share": _ratio(persist, wall),
        **_byte_totals(saves),
        "checkpoints": len(saves),
        "verdicts": dict(verdicts),
        "recovery": {
            "starts": len(restarts),
            "succeeded": ok_starts,
            "success_rate": recovery_rate,
            "mean_s": sum(rec_times) / len(rec_times) if rec_times else None,
            "max_s": max(rec_times) if rec_times else None,
        },
        "backpressure": dict(
            Counter(_str(e.get("action"), 40) for e in ev.get("backpressure", []))
        ),
        "emergency_saves": _emergency_saves(ev),
        "preemptions": preemption_totals(preemptions(events, saves, records)),
        "anomalies": anomalies[-200:],
        "series": series,
        "saves": saves,
        "restarts": restarts,
        "retention": _retention(ev),
        "manual_recoveries": [
            {str(k)[:60]: (v if isinstance(v, int | float) else str(v)[:300]) for k, v in a.items()}
            for a in list(audit)[-50:]
        ],
        "has_log": bool(events),
    }


def _preempted(s: dict[str, Any]) -> dict[str, Any]:
    """The summary's preemptions figure (none in a summary made before it existed)."""
    return _dict(s.get("preemptions")) or {"count": 0, "steps_lost": None}


def _emergency_saves(ev: Mapping[str, Sequence[Mapping[str, Any]]]) -> int:
    """Emergency saves taken, one per step: an explicit ``save_now()``, a SIGTERM (which
    logs ``sigterm`` and ``save_now`` for the same save), and the scheduler's emergency
    decisions (a save-now signal file, a node warning)."""
    steps = {
        _num(e.get("step"))
        for e in (*ev.get("save_now", ()), *ev.get("sigterm", ()))
        if _num(e.get("step")) is not None
    }
    steps |= {
        _num(e.get("step"))
        for e in ev.get("decision", ())
        if e.get("emergency") and e.get("save") and _num(e.get("step")) is not None
    }
    return len(steps)


def traits_of(s: dict[str, Any]) -> list[str]:
    """Coarse traits of a run summary, for "what low-scoring runs have in common"."""
    out = []
    if s["verdicts"].get("corrupted"):
        out.append("corrupted checkpoints")
    if s["recovery"]["starts"] > s["recovery"]["succeeded"]:
        out.append("failed starts")
    if s["recovery"]["starts"] > 1:
        out.append("restarted")
    if (s["io_share"] or 0.0) > IO_HEAVY:
        out.append(f"IO share over {IO_HEAVY:.0%}")
    if s["backpressure"]:
        out.append("persist back-pressure")
    if s["anomalies"]:
        out.append("training anomalies")
    if s["emergency_saves"]:
        out.append("emergency saves")
    if _preempted(s)["count"]:
        out.append("preempted")
    if s["manual_recoveries"]:
        out.append("manual recoveries")
    if not s["has_log"]:
        out.append("no decision log")
    return out


def fleet_summary(runs: Sequence[dict[str, Any]], low: float = LOW_HEALTH) -> dict[str, Any]:
    """``ckpt report --all``: per-run figures, totals, low runs and their shared traits
    (those at least half of the low runs have and that are rarer among the other runs)."""
    rows = []
    for s in runs:
        rows.append(
            {
                "run_id": s["run_id"],
                "health": s["health"],
                "mean_score": s["mean_score"],
                "io_share": s["io_share"],
                "recovery_success_rate": s["recovery"]["success_rate"],
                "checkpoints": s["checkpoints"],
                "corrupted": s["verdicts"].get("corrupted", 0),
                "preemptions": _preempted(s)["count"],
                "preemption_steps_lost": _preempted(s)["steps_lost"],
                "traits": traits_of(s),
            }
        )
    starts = sum(s["recovery"]["starts"] for s in runs)
    ok = sum(s["recovery"]["succeeded"] for s in runs)
    low_runs = [r for r in rows if r["health"] < low]
    others = [r for r in rows if r["health"] >= low]
    common = []
    for trait, n in Counter(t for r in low_runs for t in r["traits"]).most_common():
        among_others = sum(1 for r in others if trait in r["traits"])
        other_share = _ratio(among_others, len(others))
        # at least half of the low runs have it, and it is rarer among the others
        if n * 2 >= len(low_runs) and (other_share is None or other_share < n / len(low_runs)):
            common.append(
                {
                    "trait": trait,
                    "low_runs": n,
                    "low_share": n / len(low_runs),
                    "other_share": other_share,
                }
            )
    io = [r["io_share"] for r in rows if r["io_share"] is not None]
    return {
        "runs": rows,
        "mean_health": sum(r["health"] for r in rows) / len(rows) if rows else None,
        "mean_io_share": sum(io) / len(io) if io else None,
        "recovery_success_rate": _ratio(ok, starts),
        "low_threshold": low,
        "low_runs": [r["run_id"] for r in low_runs],
        "common_traits": common,
    }
