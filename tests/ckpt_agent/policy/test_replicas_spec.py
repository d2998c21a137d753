"""The policy's ``spec.agent.replicas`` (#31): off by default, bounds, the rules that name
the field (pydantic and CEL), the CRD carrying it."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from ckpt_agent.policy.crdgen import CRD_PATH
from ckpt_agent.policy.models import AgentSpec, CheckpointPolicySpec, ReplicasSpec
from ckpt_agent.policy.replica_contract import DEFAULT_REPLICA_PORT


def test_off_by_default() -> None:
    replicas = CheckpointPolicySpec().agent.replicas
    assert replicas == ReplicasSpec()
    assert (replicas.enabled, replicas.peers, replicas.port) == (False, 1, DEFAULT_REPLICA_PORT)


def test_wire_names_round_trip() -> None:
    wire = {"agent": {"sidecar": True, "replicas": {"enabled": True, "peers": 2, "port": 7000}}}
    spec = CheckpointPolicySpec.model_validate(wire)
    assert spec.agent.replicas == ReplicasSpec(enabled=True, peers=2, port=7000)
    assert spec.to_wire()["agent"]["replicas"] == {"enabled": True, "peers": 2, "port": 7000}
    assert CheckpointPolicySpec.model_validate(spec.to_wire()) == spec


@pytest.mark.parametrize(
    ("replicas", "field"),
    [
        ({"peers": 0}, "peers"),
        ({"peers": 4}, "peers"),
        ({"port": 80}, "port"),
        ({"port": 70000}, "port"),
        ({"ring": 2}, "ring"),
    ],
)
def test_a_bad_value_names_its_field(replicas: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointPolicySpec.model_validate({"agent": {"sidecar": True, "replicas": replicas}})
    locs = [".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    assert f"agent.replicas.{field}" in locs, locs


def test_enabled_needs_the_sidecar() -> None:
    with pytest.raises(ValidationError, match=r"agent\.replicas\.enabled needs agent\.sidecar"):
        AgentSpec.model_validate({"replicas": {"enabled": True}})
    # switched off, the section may sit in a policy without a sidecar
    assert AgentSpec.model_validate({"replicas": {"enabled": False, "peers": 3}}).sidecar is False


@pytest.mark.parametrize("port", [9399, 9400, 9401])
def test_the_port_must_not_take_a_metrics_port(port: int) -> None:
    with pytest.raises(ValidationError, match=r"agent\.replicas\.port must differ"):
        AgentSpec.model_validate(
            {"sidecar": True, "metricsPort": 9400, "replicas": {"enabled": True, "port": port}}
        )
    # a disabled section is not checked
    AgentSpec.model_validate({"sidecar": True, "replicas": {"port": port}})


def test_the_crd_carries_the_section_and_its_rules() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    agent = spec["properties"]["agent"]
    section = agent["properties"]["replicas"]["properties"]
    assert section["enabled"]["default"] is False
    assert (section["peers"]["minimum"], section["peers"]["maximum"]) == (1, 3)
    assert section["port"]["default"] == DEFAULT_REPLICA_PORT
    rules = {r["fieldPath"]: r for r in agent["x-kubernetes-validations"]}
    assert rules[".replicas.enabled"]["rule"] == "!self.replicas.enabled || self.sidecar"
    assert "sidecar: true" in rules[".replicas.enabled"]["message"]
    assert "self.metricsPort + 1" in rules[".replicas.port"]["rule"]
    # an object with CEL rules spells its default out (checked against the rules)
    assert agent["default"] == AgentSpec().to_wire()


def test_jit_save_is_off_by_default_and_needs_the_sidecar_in_a_policy() -> None:
    assert CheckpointPolicySpec().agent.jit_save is False
    with pytest.raises(ValidationError, match=r"agent\.jitSave needs agent\.sidecar"):
        CheckpointPolicySpec.model_validate({"agent": {"jitSave": True}})
    spec = CheckpointPolicySpec.model_validate({"agent": {"sidecar": True, "jitSave": True}})
    assert spec.to_wire()["agent"]["jitSave"] is True
    # a local run's config (CKPT_SHM_DIR, no sidecar container) may switch it on
    assert AgentSpec.model_validate({"jitSave": True}).jit_save is True


def test_the_crd_refuses_jit_save_without_the_sidecar_naming_the_field() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    agent = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["agent"]
    assert agent["properties"]["jitSave"] == {
        "type": "boolean",
        "default": False,
        "description": agent["properties"]["jitSave"]["description"],
    }
    (rule,) = [r for r in agent["x-kubernetes-validations"] if "jitSave" in r["rule"]]
    assert rule["fieldPath"] == ".jitSave" and "needs sidecar: true" in rule["message"]
