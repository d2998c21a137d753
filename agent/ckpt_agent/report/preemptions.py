"""The Kueue preemptions a run went through, from its decision logs (pure: no I/O).

When Kueue evicts an opted-in job the operator (``--kueue``) writes the save-now signal
``Preemption-<hash>`` to every pod (``ckpt_operator.planners.disruption_signals``); the
agent logs it as a ``signal`` event and takes an emergency full save at its next step
(a ``decision`` with ``emergency``); the pods then get SIGTERM, and the agent saves again
(a ``sigterm`` event; rank 0 of a run with several ranks logs it on every rank). After the
re-admission a new pod logs a ``start`` event: the resume. The evicted pods' work
directories go with them unless collected, so storage speaks too: a one-rank run's
emergency checkpoint records the request in its ``reason`` ("emergency: save-now signal
'Preemption-…'"), and a preemption no log shows is found there (its signal's save only;
steps lost unknown).

One preemption per request id (the operator's id is one per eviction, repeated on every
pod and rank): its time (the first ``signal``), Kueue's reason when the log holds the
operator's text ("Kueue evicted the job's Workload (<reason>): ..."; today's agent logs
the request id only, so it is usually unknown), the emergency saves that followed it
(the signal's, then SIGTERM's) joined with their checkpoints, the step saved (the newest
committed one), and the steps lost on the resume that followed: the last step trained
before it minus the step the resume kept (``next_step - 1``), ``None`` (unknown) when the
log has no resume after it. A save-now signal with another id (a node drain's
``EvictionByEvictionAPI-…``, a cordoned node's warning) is not a preemption. Stored text
(request ids, reasons) goes through :func:`ckpt_agent.text.clean`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ckpt_agent.format.layout import parse_checkpoint_id
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.text import clean

__all__ = ["PREEMPTION_REQUEST", "kueue_reason", "preemption_totals", "preemptions"]

#: How the request id of a Kueue eviction's save-now signal begins (the operator's
#: ``disruption_signals.PREEMPTION`` reason, then ``-`` and a hash of the eviction).
PREEMPTION_REQUEST = "Preemption-"
#: Longest stored string kept per field (request id, reason).
TEXT_LIMIT = 300
#: Where the operator's save-now reason names Kueue's eviction reason.
_KUEUE = re.compile(r"Kueue evicted the (?:job's )?Workload \(([^()]{1,200})\)")
#: The request in an emergency checkpoint's stored ``reason`` (the scheduler's words).
_STORED = re.compile(r"save-now signal '(" + PREEMPTION_REQUEST + r"[^'\s]{1,100})")
#: The signal event's fields that may carry the operator's reason text.
_REASON_FIELDS = ("reason", "message")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _step(v: Any) -> int | None:
    n = _num(v)
    return None if n is None else int(n)


def _text(v: Any) -> str:
    return clean(v, TEXT_LIMIT) if isinstance(v, str) else ""


def kueue_reason(text: str) -> str | None:
    """Kueue's eviction reason in the operator's save-now text (``Preempted``,
    ``PodsReadyTimeout``, ...), cleaned; None when ``text`` does not name one."""
    m = _KUEUE.search(text[:2000])  # the operator's text is short; a log's may not be
    return clean(m.group(1).strip(), TEXT_LIMIT) if m else None


def _request(e: dict[str, Any]) -> str:
    """The request id of a ``signal`` event (the first word of its content)."""
    words = e.get("request")
    return words.split(maxsplit=1)[0] if isinstance(words, str) and words.strip() else ""


def _reason_text(e: dict[str, Any]) -> str:
    return next((t for f in _REASON_FIELDS if (t := e.get(f)) and isinstance(t, str)), "")


def _is_preemption(e: dict[str, Any]) -> bool:
    """A plain save-now signal whose id (or the reason the log gives) says Preemption."""
    if e.get("kind") not in (None, "save"):
        return False
    reason = _reason_text(e)
    return (
        _request(e).startswith(PREEMPTION_REQUEST)
        or reason.startswith("Preemption:")
        or kueue_reason(reason) is not None
    )


def _new(e: dict[str, Any], last_step: int | None) -> dict[str, Any]:
    reason = _reason_text(e)
    return {
        "request": _text(_request(e)),
        "time": _num(e.get("time")),
        "reason": kueue_reason(reason),
        "message": _text(reason),
        "saves": [],
        "step_saved": None,
        "checkpoint": None,
        "last_step": last_step,
        "resume_action": None,
        "resume_checkpoint": None,
        "resumed_from": None,
        "steps_lost": None,
        "_signal_saved": False,
    }


def _add_save(row: dict[str, Any], step: int, trigger: str) -> None:
    if all(s["step"] != step for s in row["saves"]):
        row["saves"].append({"step": step, "trigger": trigger, "checkpoint": None, "status": ""})


def _resume(row: dict[str, Any], e: dict[str, Any]) -> None:
    """The ``start`` that followed: what it kept, and the steps lost since."""
    checkpoint = _text(e.get("checkpoint")) or None
    next_step = _step(e.get("next_step"))
    if next_step is None and checkpoint is not None:
        try:
            next_step = parse_checkpoint_id(checkpoint)[1] + 1
        except ValueError:
            next_step = None
    row["resume_action"] = _text(e.get("action")) or "start"
    row["resume_checkpoint"] = checkpoint
    if next_step is not None:
        row["resumed_from"] = next_step - 1  # -1: a fresh start kept nothing
        if row["last_step"] is not None:
            row["steps_lost"] = max(0, row["last_step"] - row["resumed_from"])


def _join(row: dict[str, Any], saves: Sequence[dict[str, Any]]) -> None:
    """Each emergency save's checkpoint (a full one first) and verdict; the step saved is
    the newest one that was committed."""
    for s in row["saves"]:
        found = sorted(
            (r for r in saves if r.get("step") == s["step"]), key=lambda r: r.get("tier") != "full"
        )
        if found:
            s["checkpoint"], s["status"] = found[0].get("checkpoint"), found[0].get("status", "")
    committed = [s for s in row["saves"] if s["checkpoint"] is not None]
    if committed:
        newest = max(committed, key=lambda s: s["step"])
        row["step_saved"], row["checkpoint"] = newest["step"], newest["checkpoint"]
    row["saves"].sort(key=lambda s: s["step"])
    del row["_signal_saved"]


def _from_storage(rows: dict[str, dict[str, Any]], records: Iterable[CheckpointRecord]) -> None:
    """Add the preemptions only storage shows: emergency checkpoints whose stored reason
    names a preemption's request no log event did."""
    for r in records:
        m = _STORED.search(r.reason) if r.emergency else None
        if m is None or m.group(1) in rows:
            continue
        row = rows[m.group(1)] = _new({"request": m.group(1), "time": r.created_at}, None)
        _add_save(row, r.step, "save-now")


def preemptions(
    events: Iterable[dict[str, Any]],
    saves: Sequence[dict[str, Any]] = (),
    records: Iterable[CheckpointRecord] = (),
) -> list[dict[str, Any]]:
    """One row per Kueue preemption, oldest first (see the module doc); ``events`` are the
    run's decision-log events (persister-log ones are skipped), ``saves`` the summary's
    save rows (``checkpoint``, ``step``, ``tier``, ``status``), ``records`` the run's
    stored checkpoints."""
    ordered = sorted(
        (e for e in events if e.get("source") is None),
        key=lambda e: _num(e.get("time")) or 0.0,
    )
    rows: dict[str, dict[str, Any]] = {}
    open_row: dict[str, Any] | None = None
    last_step: int | None = None
    for e in ordered:
        name = e.get("event")
        if name == "signal" and _is_preemption(e):
            key = _request(e) or f"#{len(rows)}"
            row = rows.get(key)
            if row is None:
                row = rows[key] = _new(e, last_step)
            elif row["reason"] is None:
                row["reason"] = kueue_reason(_reason_text(e))
                row["message"] = row["message"] or _text(_reason_text(e))
            open_row = row if row["resume_action"] is None else open_row
        elif name == "decision":
            step = _step(e.get("step"))
            if step is None:
                continue
            last_step = step if last_step is None else max(last_step, step)
            if open_row is None:
                continue
            open_row["last_step"] = max(open_row["last_step"] or step, step)
            if e.get("emergency") and e.get("save") and not open_row["_signal_saved"]:
                open_row["_signal_saved"] = True
                _add_save(open_row, step, "save-now")
        elif name == "sigterm" and open_row is not None:
            if (step := _step(e.get("step"))) is not None:
                open_row["last_step"] = max(open_row["last_step"] or step, step)
                _add_save(open_row, step, "SIGTERM")
        elif name == "start":
            last_step = None  # a new pod: its steps are not the old one's
            if open_row is not None:
                _resume(open_row, e)
                open_row = None
    _from_storage(rows, records)
    out = sorted(rows.values(), key=lambda r: r["time"] or 0.0)
    for row in out:
        _join(row, saves)
    return out


def preemption_totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's preemptions figure: how many, the steps they lost in all (None when no
    resume after one is in the log), how many of them lost an unknown number, and the
    rows themselves."""
    known = [r["steps_lost"] for r in rows if r["steps_lost"] is not None]
    return {
        "count": len(rows),
        "steps_lost": sum(known) if known else None,
        "lost_unknown": len(rows) - len(known),
        "saved": sum(1 for r in rows if r["step_saved"] is not None),
        "rows": list(rows),
    }
