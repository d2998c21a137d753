"""Certificates, settings, and the kopf wiring."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import kopf
import pytest
from cryptography import x509

from ckpt_operator.adapters.certs import (
    generate_ca,
    generate_serving_cert,
    service_sans,
    write_webhook_certs,
)
from ckpt_operator.adapters.metrics import Metrics
from ckpt_operator.app.handlers import MEMO_KEY, make_runtime, on_job_event, on_probe, register
from ckpt_operator.app.main import build_settings
from ckpt_operator.app.webhook_server import InstrumentedWebhookServer, fill_namespace
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import parse_config


def test_serving_cert_has_the_sans_and_chains_to_the_ca(tmp_path: Path) -> None:
    sans = [*service_sans("ckpt-operator-webhook", "ckpt-system"), "127.0.0.1"]
    paths = write_webhook_certs(tmp_path, sans)
    cert = x509.load_pem_x509_certificate(paths.cert.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ckpt-operator-webhook.ckpt-system.svc" in ext.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in ext.get_values_for_type(x509.IPAddress)
    ca = x509.load_pem_x509_certificate(paths.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert paths.key.stat().st_mode & 0o077 == 0
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(paths.cert, paths.key)  # a usable pair


def test_serving_cert_needs_a_name() -> None:
    with pytest.raises(ValueError):
        generate_serving_cert(generate_ca(), [])


def test_config_from_flags_and_env(tmp_path: Path) -> None:
    cfg = parse_config(
        ["--webhook-cert-dir", str(tmp_path), "-n", "a", "-n", "b", "--metrics-port", "0"],
        {
            "CKPT_OPERATOR_AGENT_IMAGE": "reg/agent:1",
            "CKPT_OPERATOR_METRICS_PORT": "9999",
            "CKPT_OPERATOR_SIDECAR_COMMAND": "python -m ckpt_agent.flash.sidecar",
        },
    )
    assert cfg.namespaces == ("a", "b") and cfg.metrics_port == 0  # the flag wins
    assert cfg.injection.agent_image == "reg/agent:1"
    assert cfg.injection.sidecar_command == ("python", "-m", "ckpt_agent.flash.sidecar")
    assert cfg.webhook.cert_dir == tmp_path and cfg.standalone
    env_only = parse_config(
        [], {"CKPT_OPERATOR_WEBHOOK": "false", "CKPT_OPERATOR_NAMESPACES": "x,y"}
    )
    assert not env_only.webhook.enabled and env_only.namespaces == ("x", "y")


def test_switches_and_lists_take_the_flag_then_the_variable_then_the_default() -> None:
    env = {
        "CKPT_OPERATOR_WEBHOOK": "false",
        "CKPT_OPERATOR_RETENTION": "off",
        "CKPT_OPERATOR_READ_STORAGE_SECRETS": "no",
        "CKPT_OPERATOR_WEBHOOK_EXTRA_SANS": "a.example, b.example c.example",
        "CKPT_OPERATOR_NODE_POOL_LABELS": "pool/x",
    }
    from_env = parse_config([], env)
    assert not from_env.webhook.enabled and not from_env.retention.enabled
    assert not from_env.read_storage_secrets
    assert from_env.webhook.extra_sans == ("a.example", "b.example", "c.example")
    assert from_env.recovery.node_pool_labels == ("pool/x",)
    flags = [
        *("--webhook=false", "--retention=true", "--read-storage-secrets=true"),
        *("--webhook-extra-san", "d.example", "--node-pool-label", "pool/y"),
    ]
    from_flags = parse_config(flags, env)
    assert from_flags.retention.enabled and from_flags.read_storage_secrets
    assert from_flags.webhook.extra_sans == ("d.example",)
    assert from_flags.recovery.node_pool_labels == ("pool/y",)
    defaults = parse_config(["--webhook=false"], {"CKPT_OPERATOR_RETENTION": ""})
    assert defaults.retention.enabled and defaults.read_storage_secrets  # empty: the default
    assert defaults.webhook.extra_sans == () and defaults.recovery.node_pool_labels
    with pytest.raises(argparse.ArgumentTypeError, match="not a boolean"):
        parse_config(["--webhook=false"], {"CKPT_OPERATOR_RETENTION": "maybe"})


def test_the_replica_rack_label_from_the_flag_or_the_variable() -> None:
    assert parse_config(["--webhook=false"], {}).replica_rack_label == ""
    env = {"CKPT_OPERATOR_REPLICA_RACK_LABEL": "example.com/rack"}
    assert parse_config(["--webhook=false"], env).replica_rack_label == "example.com/rack"
    flag = ["--webhook=false", "--replica-rack-label", "topology.example.com/rack"]
    assert parse_config(flag, env).replica_rack_label == "topology.example.com/rack"


def test_webhook_without_certificate_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--webhook-cert-dir"):
        parse_config([], {})


def test_settings_use_our_prefix_and_the_webhook_server(tmp_path: Path) -> None:
    cfg = parse_config(
        [
            "--webhook-generate-certs",
            "--webhook-host",
            "127.0.0.1",
            "--webhook-managed",
            "ckpt-operator.ckpt.dev",
        ],
        {},
    )
    settings = build_settings(cfg, Metrics())
    assert isinstance(settings.admission.server, InstrumentedWebhookServer)
    assert settings.admission.managed == "ckpt-operator.ckpt.dev"
    assert settings.persistence.finalizer.startswith(c.KOPF_PREFIX)
    server = settings.admission.server
    assert server.certfile is not None and Path(server.certfile).exists()
    assert server.host == "127.0.0.1" and server.port == 9443


def test_registered_handlers() -> None:
    registry = register(kopf.OperatorRegistry())
    hooks = {h.id: h for h in registry._webhooks.get_all_handlers()}
    inject = hooks[c.WEBHOOK_INJECT_ID]
    # fails closed (issue #19): an opted-in pod is refused rather than run without the agent
    assert not inject.ignore_failures and inject.side_effects and inject.operations == ["CREATE"]
    label = hooks[c.WEBHOOK_LABEL_JOB_ID]
    assert label.operations == ["CREATE"] and str(label.reason) == "mutating"
    validate = hooks[c.WEBHOOK_VALIDATE_ID]
    assert not validate.ignore_failures and set(validate.operations or ()) == {"CREATE", "UPDATE"}
    # nothing that would put a finalizer on users' objects
    assert registry._spawning.get_all_handlers() == []
    without = register(kopf.OperatorRegistry(), webhooks=False)
    assert without._webhooks.get_all_handlers() == []


def test_job_events_drive_recovery(world: Any, fixture: Any, rec: Any) -> None:
    world.source.runs["mnist-ddp-5f0c6a7e"] = [rec("pulse", 1200, created_at=1.0)]
    job = world.api.add_job(fixture("pytorchjob_failed.json"))

    async def main() -> dict[str, Any]:
        runtime = make_runtime(world.deps)
        memo = kopf.Memo({MEMO_KEY: runtime})
        await on_job_event(type=None, body=kopf.Body(job), memo=memo)
        for _ in range(200):
            if not runtime.recovery.active:
                break
            await asyncio.sleep(0.01)
        probe = on_probe(memo=memo)
        await runtime.recovery.stop()
        return probe

    probe = asyncio.run(main())
    assert ("ml-team", "mnist-ddp-r1") in world.api.jobs
    assert probe["activeRecoveries"] == 0


def test_fill_namespace() -> None:
    req = {"request": {"namespace": "ns", "object": {"metadata": {}}, "oldObject": None}}
    assert fill_namespace(req)["request"]["object"]["metadata"]["namespace"] == "ns"
    assert fill_namespace({"nope": 1}) == {"nope": 1}


def test_console_script_help(capsys: pytest.CaptureFixture[str]) -> None:
    from ckpt_operator.app.main import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--webhook-cert-dir" in out and "--agent-image" in out
