"""The CRD YAML is generated from the models; committed copies must not drift."""

from __future__ import annotations

from typing import Any

import yaml

from ckpt_agent.policy import CheckpointPolicySpec, RetentionSpec, crdgen


def test_committed_crd_matches_the_models() -> None:
    assert crdgen.CRD_PATH.read_text() == crdgen.render_crd(), (
        "crds/ is stale: run `python -m ckpt_agent.policy.crdgen`"
    )


def test_committed_chart_crd_matches_the_models() -> None:
    assert crdgen.CHART_CRD_PATH.read_text() == crdgen.render_chart_crd(), (
        "the chart's CRD is stale: run `python -m ckpt_agent.policy.crdgen`"
    )


def test_check_mode_reports_drift(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stale = tmp_path / "crd.yaml"
    stale.write_text("old")
    monkeypatch.setattr(crdgen, "CRD_PATH", stale)
    monkeypatch.setattr(crdgen, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(crdgen, "CHART_CRD_PATH", tmp_path / "chart.yaml")
    assert crdgen.main(["--check"]) == 1
    assert crdgen.main([]) == 0
    assert crdgen.main(["--check"]) == 0


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for k, v in node.get("properties", {}).items():
            out.extend(_walk(v, f"{path}.{k}"))
        if isinstance(node.get("additionalProperties"), dict):
            out.extend(_walk(node["additionalProperties"], f"{path}.*"))
        if isinstance(node.get("items"), dict):
            out.extend(_walk(node["items"], f"{path}[]"))
    return out


def test_schema_is_structural() -> None:
    crd = yaml.safe_load(crdgen.render_crd())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    forbidden = {"$ref", "anyOf", "allOf", "oneOf", "const", "title", "$defs"}
    for path, node in _walk(schema):
        assert not forbidden & node.keys(), (path, forbidden & node.keys())
        if "properties" in node:
            assert "additionalProperties" not in node, path
            assert node.get("type") == "object", path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if path not in ("", ".metadata", ".status", ".status.conditions[]"):
            assert "type" in node, path


def test_schema_carries_the_validation_the_issue_asks_for() -> None:
    crd = yaml.safe_load(crdgen.render_crd())
    assert crd["spec"]["names"]["shortNames"] == ["ckptpol"]
    assert crd["spec"]["group"] == "ckpt.dev"
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pulse = spec["properties"]["tiers"]["properties"]["pulse"]["properties"]
    assert pulse["minInterval"]["minimum"] == 1
    rules = [r["rule"] for r in spec["properties"]["tiers"]["x-kubernetes-validations"]]
    assert "self.pulse.minInterval <= self.pulse.maxInterval" in rules
    loss_w = spec["properties"]["scheduler"]["properties"]["loss"]["properties"]["weight"]
    assert (loss_w["minimum"], loss_w["maximum"]) == (0, 1)
    tier = spec["properties"]["scheduler"]["properties"]["system"]["properties"]["emergencyTier"]
    assert tier["enum"] == ["pulse", "full"]
    keep = spec["properties"]["retention"]["properties"]["importantKeep"]
    assert keep["minimum"] == 1
    assert spec["properties"]["storage"]["properties"]["s3"]["required"] == ["bucket"]
    # nested objects default to {} so the API server fills nested defaults; objects with
    # CEL rules spell their defaults out (the API server checks defaults against the rules)
    assert spec["properties"]["compression"]["default"] == {}
    assert spec["properties"]["tiers"]["default"] == CheckpointPolicySpec().tiers.to_wire()
    assert spec["properties"]["retention"]["default"] == RetentionSpec().to_wire()
    assert pulse["baseInterval"]["default"] == 100
