"""The policy model: defaults, validation messages and the agent-config round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from ckpt_agent.policy import (
    AgentConfig,
    CheckpointPolicy,
    CheckpointPolicySpec,
    SSEMode,
    StorageType,
    Tier,
)
from ckpt_agent.policy.agent_config import (
    ENV_CONFIG,
    ENV_METRICS_ADDR,
    ENV_METRICS_PORT,
    ENV_RUN_ID,
    ENV_STORAGE_URL,
)
from ckpt_agent.policy.storage_models import LocalStorageSpec, StorageSpec
from ckpt_agent.storage.fs import LocalStorage


def test_defaults_follow_the_design() -> None:
    s = CheckpointPolicySpec()
    assert (s.scheduler.loss.weight, s.scheduler.gradient.weight, s.scheduler.system.weight) == (
        0.4,
        0.35,
        0.25,
    )
    assert s.scheduler.loss.ewma_alpha == 0.2
    assert s.scheduler.loss.window == 20
    assert s.scheduler.loss.slope_threshold == 0.05
    assert s.scheduler.loss.consecutive_steps == 3
    assert s.scheduler.gradient.sample_every == 10
    assert s.scheduler.gradient.history == 50
    assert s.scheduler.gradient.consecutive_anomalies == 2
    assert s.scheduler.system.write_latency_ms == 15.0
    assert s.scheduler.system.sustained_seconds == 5.0
    assert s.scheduler.pulse_now_score == 0.7
    assert (
        s.tiers.pulse.base_interval,
        s.tiers.pulse.min_interval,
        s.tiers.pulse.max_interval,
    ) == (
        100,
        10,
        500,
    )
    assert s.tiers.heartbeat.every_steps == 1
    assert s.tiers.full.every_steps == 1000
    assert s.tiers.full.long_run_every_steps == 500
    assert s.tiers.full.long_run_after_hours == 15 * 24
    assert s.compression.codec == "auto" and s.compression.level == 3
    assert (s.retention.critical_score, s.retention.important_score) == (0.8, 0.5)
    assert (s.retention.important_keep, s.retention.routine_keep) == (3, 1)
    assert s.recovery.max_chain_links == 5
    assert s.scheduler.risk.stall_budget == 0.03
    assert s.storage.type == StorageType.LOCAL


def test_camel_case_on_the_wire() -> None:
    wire = CheckpointPolicySpec().to_wire()
    assert "pulseNowScore" in wire["scheduler"]
    assert "minInterval" in wire["tiers"]["pulse"]
    assert CheckpointPolicySpec.model_validate(wire) == CheckpointPolicySpec()


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"tiers": {"pulse": {"minInterval": -1}}}, "tiers.pulse.minInterval"),
        ({"tiers": {"pulse": {"minInterval": 600, "maxInterval": 500}}}, "minInterval"),
        ({"tiers": {"pulse": {"baseInterval": 5}}}, "baseInterval"),
        ({"scheduler": {"loss": {"weight": 1.5}}}, "scheduler.loss.weight"),
        ({"scheduler": {"gradient": {"weight": -0.1}}}, "scheduler.gradient.weight"),
        ({"scheduler": {"system": {"emergencyTier": "organ"}}}, "emergencyTier"),
        ({"tiers": {"organ": {}}}, "tiers.organ"),
        ({"retention": {"importantKeep": 0}}, "retention.importantKeep"),
        ({"retention": {"routineKeep": 0}}, "retention.routineKeep"),
        ({"retention": {"importantScore": 0.9, "criticalScore": 0.8}}, "importantScore"),
        ({"storage": {"type": "s3"}}, "storage.s3"),
        ({"storage": {"type": "gcs"}}, "storage.type"),
        ({"storage": {"local": {"path": "relative/dir"}}}, "storage.local.path"),
        (
            {
                "storage": {
                    "type": "s3",
                    "s3": {"bucket": "b" * 3, "serverSideEncryption": {"mode": "aws:kms"}},
                }
            },
            "kmsKeyId",
        ),
        ({"compression": {"level": 0}}, "compression.level"),
        ({"recovery": {"maxRestarts": -1}}, "recovery.maxRestarts"),
    ],
)
def test_bad_policies_are_rejected_naming_the_field(patch: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        CheckpointPolicySpec.model_validate(patch)
    text = str(err.value)
    # pydantic names the path with the wire aliases, dotted
    dotted = [".".join(str(p) for p in e["loc"]) for e in err.value.errors()]
    assert any(field in d for d in dotted) or field in text, (dotted, text)


def test_full_object_parses_and_keeps_metadata() -> None:
    obj = CheckpointPolicy.model_validate(
        {
            "apiVersion": "ckpt.dev/v1alpha1",
            "kind": "CheckpointPolicy",
            "metadata": {"name": "p", "namespace": "ns", "uid": "123", "generation": 2},
            "spec": {"tiers": {"pulse": {"baseInterval": 50}}},
        }
    )
    assert obj.metadata.name == "p"
    assert obj.spec.tiers.pulse.base_interval == 50
    assert obj.metadata.model_extra == {"uid": "123"}


def _s3_spec() -> CheckpointPolicySpec:
    return CheckpointPolicySpec.model_validate(
        {
            "storage": {
                "type": "s3",
                "s3": {
                    "bucket": "ckpts",
                    "prefix": "team-a/",
                    "endpoint": "http://minio:9000",
                    "pathStyle": True,
                    "credentialsSecret": {"name": "s3-creds"},
                    "serverSideEncryption": {"mode": "aws:kms", "kmsKeyId": "k-1"},
                    "partSizeMb": 32,
                },
            },
            "scheduler": {"risk": {"mtbfSeconds": 3600}},
            "tiers": {"full": {"everySteps": 200}},
            "agent": {"sidecar": True, "metricsPort": 9500},
        }
    )


@pytest.mark.parametrize(
    "spec",
    [
        CheckpointPolicySpec(),
        _s3_spec(),
        CheckpointPolicySpec.model_validate(
            {"storage": {"local": {"path": "/mnt/ckpt", "pvcName": "shared"}}}
        ),
        CheckpointPolicySpec.model_validate(
            {
                "preemption": {
                    "priorityBoost": {"enabled": True, "maxBoost": 7},
                    "maxGraceSeconds": 9,
                }
            }
        ),
    ],
    ids=["defaults", "s3", "pvc", "preemption"],
)
def test_policy_to_agent_config_round_trip(spec: CheckpointPolicySpec) -> None:
    cfg = AgentConfig.from_policy(spec, run_id="run-1", resume_from="pulse_step_000000000100")
    assert cfg.run_id == "run-1"
    assert cfg.resume_from == "pulse_step_000000000100"
    assert cfg.metrics_port == spec.agent.metrics_port
    back = AgentConfig.from_json(cfg.to_json())
    assert back == cfg
    assert back.to_policy_spec() == spec


def test_s3_url_and_options() -> None:
    cfg = AgentConfig.from_policy(_s3_spec(), run_id="r")
    assert cfg.storage_url == "s3://ckpts/team-a"
    assert cfg.s3 is not None
    assert cfg.s3.path_style is True
    assert cfg.s3.server_side_encryption.mode == SSEMode.KMS
    # credentials are a reference, never a value
    assert 'secretAccessKey"' not in cfg.to_json()
    assert cfg.s3.credentials_secret is not None and cfg.s3.credentials_secret.name == "s3-creds"


def test_from_env_file_and_overrides(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = AgentConfig.from_policy(CheckpointPolicySpec(), run_id="from-file")
    f = tmp_path / "agent.json"
    f.write_text(cfg.to_json())
    env = {ENV_CONFIG: str(f), ENV_STORAGE_URL: str(tmp_path / "store")}
    got = AgentConfig.from_env(env)
    assert got.run_id == "from-file"
    assert got.storage_url == f"file://{tmp_path / 'store'}"
    got2 = AgentConfig.from_env({**env, ENV_RUN_ID: "over"})
    assert got2.run_id == "over"
    assert (got2.metrics_port, got2.metrics_addr) == (9400, "0.0.0.0")  # the policy's
    got3 = AgentConfig.from_env({**env, ENV_METRICS_PORT: "9401", ENV_METRICS_ADDR: "::"})
    assert (got3.metrics_port, got3.metrics_addr) == (9401, "::")


def test_from_env_missing_file_says_what_to_do(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="mount the policy ConfigMap"):
        AgentConfig.from_env({ENV_CONFIG: str(tmp_path / "nope.json")})


def test_from_env_defaults_without_anything() -> None:
    cfg = AgentConfig.from_env({})
    assert cfg.run_id == "local"
    assert json.loads(cfg.to_json())["tiers"]["pulse"]["maxInterval"] == 500


def test_tier_enum_values() -> None:
    assert [t.value for t in Tier] == ["heartbeat", "pulse", "full"]


@pytest.mark.parametrize("name", ["a%20b", "x?y", "c#d", "plain", "sp ace", "per%cent%"])
def test_a_local_path_survives_its_file_url(tmp_path: Path, name: str) -> None:
    """The URL the agent is given opens the folder the policy names, whatever its name
    (the agent unquotes the URL's path: an unquoted ``%20`` would open ``a b``)."""
    path = str(tmp_path / name)
    spec = StorageSpec(local=LocalStorageSpec(path=path))
    assert LocalStorage.from_url(spec.url()).root == Path(path)
    cfg = AgentConfig.from_policy(CheckpointPolicySpec(storage=spec), run_id="r")
    assert cfg.to_policy_spec().storage.local.path == path
