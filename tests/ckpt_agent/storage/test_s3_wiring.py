"""The policy's S3 section reaches every opener of the storage, against a real MinIO.

The endpoint is set in the agent config only (the pod's environment has just the
credentials): the validator's loader process and the ``ckpt`` CLI must both reach it.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.builder import PersistBuilder
from ckpt_agent.persist.writer import TensorSource
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import checkpoint_id

pytestmark = pytest.mark.s3

BUCKET = "ckpt-test"
RUN = "run1"


@pytest.fixture
def config(minio: Any, monkeypatch: pytest.MonkeyPatch) -> AgentConfig:
    """An S3 config whose endpoint is in the config only; the credentials are in the env."""
    for var in [v for v in os.environ if v.startswith(("CKPT_S3_", "AWS_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("CKPT_S3_ACCESS_KEY_ID", minio.access_key)
    monkeypatch.setenv("CKPT_S3_SECRET_ACCESS_KEY", minio.secret_key)
    monkeypatch.setenv("CKPT_S3_CONNECT_TIMEOUT_S", "2")
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": f"s3://{BUCKET}/wiring-{uuid.uuid4().hex[:12]}",
            "s3": {"endpoint": minio.endpoint, "partSizeMb": 5, "maxAttempts": 2},
            "validation": {"loadInSubprocess": True},
        }
    )


def test_the_validators_loader_reaches_the_configured_endpoint(
    config: AgentConfig, tmp_path: Path
) -> None:
    parts = PersistBuilder(config).build(tmp_path / "catalog.sqlite", metrics=Metrics())
    try:
        data = b"".join(struct.pack("<f", i * 0.5) for i in range(1024))
        meta = CheckpointMeta(run_id=RUN, step=3, tier=Tier.PULSE, sections=("model",))
        state = {"model": {"w": {"__tensor__": "model/w"}}}
        src = [TensorSource("model/w", "float32", (1024,), memoryview(data))]
        parts.writer.commit(meta, [parts.writer.write_rank(meta, 0, state, src)])
        outcome = parts.validator.validate(
            checkpoint_id(Tier.PULSE, 3), {"model/w": ("float32", (1024,))}
        )
        assert outcome.valid, outcome.reason
        assert "load (subprocess)" in outcome.checks
        assert parts.validator.env["CKPT_S3_ENDPOINT_URL"] == config.s3.endpoint  # type: ignore[union-attr]
    finally:
        parts.close()

    # the CLI, given the same config, reads the same storage
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config.to_wire()))
    res = CliRunner().invoke(
        app,
        ["ls", "--storage", config.storage_url, "--run-id", RUN, "--config", str(cfg), "--json"],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in json.loads(res.output)] == [checkpoint_id(Tier.PULSE, 3)]
