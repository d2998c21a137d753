"""``ckpt report``: what the checkpointing of a run (or of every run) did, as HTML or JSON.

:mod:`.data` reads (storage, decision and persister logs), :mod:`.summary` computes (pure),
:mod:`.plots` draws (matplotlib → inline SVG, the ``report`` extra) and
:mod:`.html` lays out one self-contained page. Never imports torch.
"""

from __future__ import annotations

from ckpt_agent.report.data import LOG_GLOB, SIDECAR_GLOB, RunData, load_run
from ckpt_agent.report.html import fleet_page, run_page
from ckpt_agent.report.plots import available, fleet_plot, plot_all
from ckpt_agent.report.summary import LOW_HEALTH, fleet_summary, run_summary, traits_of

__all__ = [
    "LOG_GLOB",
    "LOW_HEALTH",
    "SIDECAR_GLOB",
    "RunData",
    "available",
    "fleet_page",
    "fleet_plot",
    "fleet_summary",
    "load_run",
    "plot_all",
    "run_page",
    "run_summary",
    "traits_of",
]
