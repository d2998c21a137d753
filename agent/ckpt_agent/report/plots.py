"""The report's plots: matplotlib figures rendered to inline SVG (no files, no network).

matplotlib is the ``report`` extra (``pip install 'ckpt-operator[report]'``);
:func:`available` says whether it is installed. Text drawn into a plot comes
from our own vocabulary (tiers, component and rule names) and is still escaped
for matplotlib's mathtext (``$``) and cut short.
"""

from __future__ import annotations

import io
import re
from typing import Any

plt: Any
try:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.figure import Figure

    plt = pyplot
except ImportError:  # the `report` extra is not installed
    plt = None

__all__ = ["TIER_COLORS", "available", "fleet_plot", "plot_all"]

TIER_COLORS = {"heartbeat": "#9e9e9e", "pulse": "#1f77b4", "full": "#d62728"}
_STATUS_MARKERS = {"valid": "o", "corrupted": "X", "pending": "s", "superseded": "d"}
_SVG_HEAD = re.compile(r"^.*?(?=<svg)", re.S)
_SVG_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.S)


def available() -> bool:
    """Whether matplotlib (the ``report`` extra) is installed."""
    return plt is not None


def _label(text: object) -> str:
    return str(text)[:40].replace("$", r"\$")


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return _SVG_METADATA.sub("", _SVG_HEAD.sub("", buf.getvalue(), count=1), count=1)


def _fig(title: str, xlabel: str = "step") -> tuple[Figure, Any]:
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=96)
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _empty(ax: Any, what: str) -> None:
    ax.text(
        0.5,
        0.5,
        f"no {what} in the decision log",
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="#777",
    )


def loss_plot(s: dict[str, Any]) -> str:
    """Loss per step, checkpoints marked by tier (marker: validation verdict)."""
    fig, ax = _fig("Loss, with checkpoints by tier")
    loss = s["series"]["loss"]
    if loss:
        ax.plot([p[0] for p in loss], [p[1] for p in loss], color="#444", lw=1, label="loss")
    else:
        _empty(ax, "loss values")
    by_step = dict((p[0], p[1]) for p in loss)
    lo = min(by_step.values()) if by_step else 0.0
    seen: set[tuple[str, str]] = set()
    for row in s["saves"]:
        tier, status = row["tier"], row["status"]
        key = (tier, status)
        ax.scatter(
            [row["step"]],
            [by_step.get(row["step"], lo)],
            color=TIER_COLORS.get(tier, "#2ca02c"),
            marker=_STATUS_MARKERS.get(status, "^"),
            s=42,
            zorder=3,
            label=None if key in seen else _label(f"{tier} ({status})"),
        )
        seen.add(key)
    ax.set_ylabel("loss")
    if loss or seen:
        ax.legend(fontsize=8, loc="upper right")
    return _svg(fig)


def score_plot(s: dict[str, Any]) -> str:
    """The scheduler's score and each signal layer's contribution (stacked)."""
    fig, ax = _fig("Score and each layer's contribution")
    pts = s["series"]["score"]
    if pts:
        steps = [p[0] for p in pts]
        names = sorted({k for p in pts for k in p[2]})
        layers = [[p[2].get(n, 0.0) for p in pts] for n in names]
        if names:
            ax.stackplot(steps, *layers, labels=[_label(n) for n in names], alpha=0.55)
        ax.plot(steps, [p[1] for p in pts], color="black", lw=1.2, label="score")
        ax.legend(fontsize=8, loc="upper right")
    else:
        _empty(ax, "decisions")
    ax.set_ylabel("score")
    return _svg(fig)


def interval_plot(s: dict[str, Any]) -> str:
    """The dynamic pulse interval, coloured by the rule that set it."""
    fig, ax = _fig("Dynamic interval and the rule that set it")
    pts = s["series"]["interval"]
    if pts:
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="#555", lw=1)
        for rule in sorted({p[2] for p in pts}):
            sel = [p for p in pts if p[2] == rule]
            ax.scatter([p[0] for p in sel], [p[1] for p in sel], s=10, label=_label(rule or "?"))
        ax.legend(fontsize=8, loc="upper right", title="rule", title_fontsize=8)
    else:
        _empty(ax, "decisions")
    ax.set_ylabel("interval (steps)")
    return _svg(fig)


_BAR_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c")


def _save_bars(s: dict[str, Any], title: str, keys: tuple[str, ...], ylabel: str) -> str:
    """One group of bars per save that knows any of ``keys`` (an unknown one: no bar)."""
    fig, ax = _fig(title, "checkpoint step")
    rows = [r for r in s["saves"] if any(r[k] is not None for k in keys)]
    if rows:
        x = list(range(len(rows)))
        w = 0.8 / len(keys)
        for n, (key, color) in enumerate(zip(keys, _BAR_COLORS, strict=False)):
            off = (n - (len(keys) - 1) / 2) * w
            ax.bar([i + off for i in x], [r[key] or 0 for r in rows], w, label=key, color=color)
        step = max(1, len(rows) // 20)
        ax.set_xticks(x[::step], [str(r["step"]) for r in rows][::step], fontsize=8)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "saves")
    ax.set_ylabel(ylabel)
    return _svg(fig)


def plot_all(s: dict[str, Any]) -> dict[str, str]:
    """Every plot of a run report: title → inline SVG."""
    return {
        "loss": loss_plot(s),
        "score": score_plot(s),
        "interval": interval_plot(s),
        "time": _save_bars(s, "Stall and persist time per save", ("stall_s", "persist_s"), "s"),
        "bytes": _save_bars(
            s,
            "Bytes written vs a full save (dedup) vs raw (compression)",
            ("bytes_written", "bytes_full", "bytes_raw"),
            "bytes",
        ),
    }


def fleet_plot(f: dict[str, Any]) -> str:
    """``--all``: health score per run, low runs in red."""
    fig, ax = _fig("Health score per run", "run")
    rows = f["runs"]
    if rows:
        x = list(range(len(rows)))
        colors = ["#d62728" if r["health"] < f["low_threshold"] else "#2ca02c" for r in rows]
        ax.bar(x, [r["health"] for r in rows], color=colors)
        ax.axhline(f["low_threshold"], color="#777", ls="--", lw=1)
        step = max(1, len(rows) // 30)
        ax.set_xticks(
            x[::step],
            [_label(r["run_id"]) for r in rows][::step],
            rotation=30,
            fontsize=8,
            ha="right",
        )
    else:
        _empty(ax, "runs")
    ax.set_ylim(0, 100)
    ax.set_ylabel("health")
    return _svg(fig)
