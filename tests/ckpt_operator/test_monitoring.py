"""The chart's monitoring: PodMonitor for the agents, dashboard, alerts proven with promtool.

Every metric a dashboard panel or an alert names must exist in the code (the
agent's and the operator's registries). The alerts are checked by the real
Prometheus tooling: ``promtool check rules`` and ``promtool test rules`` with
``alerts/alerts_test.yaml`` (a unit test for every alert). promtool comes from
``$PROMTOOL``, ``promtool`` on PATH, or ``e2e/build-tools.sh promtool``; those
tests skip, saying so, only when none exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from ckpt_agent.metrics import Metrics as AgentMetrics
from ckpt_operator.adapters.metrics import Metrics as OperatorMetrics

HERE = Path(__file__).resolve().parent
ALERT_TESTS = HERE / "alerts" / "alerts_test.yaml"
MONITORING = (
    "metrics.podMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "dashboard.enabled=true",
)
#: Series Prometheus makes itself (not ours to define).
BUILTIN = {"up"}


def _chart_tests() -> ModuleType:
    """test_chart.py's helm helpers (find_helm, render, only), without collecting its tests."""
    spec = importlib.util.spec_from_file_location("_chart_helpers", HERE / "test_chart.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


chart = _chart_tests()
pytestmark = pytest.mark.skipif(
    chart.HELM is None,
    reason="helm binary not found ($HELM, PATH, or e2e/build-tools.sh helm): chart not checked",
)


def find_promtool() -> str | None:
    explicit = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if explicit:
        return explicit
    cache = Path(os.environ.get("CKPT_TOOLS_CACHE", Path.home() / ".cache/ckpt-operator/tools"))
    built = [p / "promtool" for p in cache.glob("promtool-*") if (p / ".complete").exists()]
    return str(max(built, key=lambda p: p.stat().st_mtime)) if built else None


def _exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry can expose (also for labelled metrics with no child yet)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("_sum", "_count", "_created"),
    }
    out = set()
    for family in registry.collect():
        out |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return out


def _monitoring() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    objs = chart.render(*MONITORING)
    rule = chart.only(objs, "PrometheusRule")
    board = json.loads(chart.only(objs, "ConfigMap")["data"]["ckpt-operator.json"])
    return chart.only(objs, "PodMonitor"), rule, board


def test_pod_monitor_scrapes_the_injected_agents() -> None:
    pm, _, _ = _monitoring()
    assert pm["spec"]["selector"]["matchLabels"] == {"ckpt.dev/injected": "true"}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    ports = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
    assert ports == ["ckpt-metrics", "ckpt-sc-metrics"]  # the ports the webhook injects
    assert "PodMonitor" not in chart.kinds(chart.render())  # opt-in


def _ckpt_names(expr: str) -> set[str]:
    """Every ``ckpt_*`` token of a PromQL expression, whatever follows it (``{``, ``[``, an
    operator, a comparison, the end): none can hide from the check below."""
    return set(re.findall(r"\bckpt_[a-z0-9_]+", expr))


def test_metric_names_are_found_whatever_follows_them() -> None:
    expr = "ckpt_a > 1 and ckpt_b{x='y'} / ckpt_c[5m] or ckpt_d<2 unless (ckpt_e)+ckpt_f"
    assert _ckpt_names(expr) == {f"ckpt_{c}" for c in "abcdef"}


def test_every_metric_in_panels_and_alerts_exists_in_the_code() -> None:
    _, rule, board = _monitoring()
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    named = {m for e in exprs for m in _ckpt_names(e)}
    known = _exposed_names(AgentMetrics().registry) | _exposed_names(OperatorMetrics().registry)
    assert named - BUILTIN <= known, f"not defined in code: {sorted(named - BUILTIN - known)}"
    for metric in (  # the agent questions the dashboard answers
        "ckpt_save_latency_seconds_bucket",
        "ckpt_stall_seconds_sum",
        "ckpt_io_time_ratio",
        "ckpt_bytes_written_total",
        "ckpt_checkpoints_total",
        "ckpt_recoveries_total",
        "ckpt_recovery_seconds_bucket",
    ):
        assert metric in named


def test_every_alert_has_a_promtool_unit_test() -> None:
    _, rule, _ = _monitoring()
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    tested = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == tested
    assert {
        "CkptRecoverySuccessRateLow",
        "CkptSaveLatencyHigh",
        "CkptValidationFailures",
        "CkptCrashLoop",
        "CkptAgentMissing",
    } <= alerts


def test_alerts_with_promtool(tmp_path: Path) -> None:
    promtool = find_promtool()
    if promtool is None:
        pytest.skip(
            "promtool not found ($PROMTOOL, PATH, or `e2e/build-tools.sh promtool`): "
            "alert rules not checked by Prometheus"
        )
    _, rule, _ = _monitoring()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts_test.yaml")
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "alerts_test.yaml"]):
        res = subprocess.run(
            [promtool, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert res.returncode == 0, f"promtool {' '.join(args)}:\n{res.stdout}\n{res.stderr}"


def test_operator_recovery_success_ratio() -> None:
    m = OperatorMetrics()

    def ratio() -> float | None:
        return m.registry.get_sample_value("ckpt_operator_recovery_success_ratio")

    assert ratio() == 1.0  # nothing attempted: nothing failed
    for _ in range(49):
        m.recoveries.labels("success", "Restarted").inc()
    m.recoveries.labels("failure", "CrashLoop").inc()
    assert ratio() == pytest.approx(0.98)
