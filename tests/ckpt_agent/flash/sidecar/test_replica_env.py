"""``ckpt sidecar``'s replication from the webhook's environment (flash.sidecar.replica_env):
off when unset, every value checked, a bad one named and replication off."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.flash.sidecar.replica_env import (
    ReplicaEnvError,
    replica_options_from_env,
    replicas_or_off,
)

GOOD = {
    "CKPT_REPLICA_PORT": "7471",
    "CKPT_REPLICA_PEERS": "job-worker-0.ns.svc:7471, job-worker-1.ns.svc:7471",
    "CKPT_REPLICA_SECRET_FILE": "/etc/ckpt-replica/secret",
    "CKPT_REPLICA_JOB": "team-a/job",
    "CKPT_NODE_NAME": "gpu-node-3.zone-a",
}


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in GOOD.items() if k not in names}


def test_unset_is_off() -> None:
    assert replica_options_from_env({}) is None
    # the pod's other variables do not switch it on
    assert replica_options_from_env({"CKPT_NODE_NAME": "n1", "CKPT_REPLICA_JOB": "a/b"}) is None
    assert replica_options_from_env({"CKPT_REPLICA_PORT": "  "}) is None


def test_the_webhooks_values_become_the_options() -> None:
    assert replica_options_from_env(GOOD) == ReplicaOptions(
        node="gpu-node-3.zone-a",
        namespace="team-a",
        job_id="job",
        secret_file="/etc/ckpt-replica/secret",
        peers=("job-worker-0.ns.svc:7471", "job-worker-1.ns.svc:7471"),
        listen_port=7471,
    )


def test_no_peers_serves_only() -> None:
    options = replica_options_from_env({**GOOD, "CKPT_REPLICA_PEERS": ""})
    assert options is not None and options.peers == () and options.listen_port == 7471
    options = replica_options_from_env(_without("CKPT_REPLICA_PEERS"))
    assert options is not None and options.peers == ()


def test_the_listen_address_defaults_to_every_address_and_can_be_named() -> None:
    options = replica_options_from_env(GOOD)
    assert options is not None and options.listen_host == "0.0.0.0"
    options = replica_options_from_env({**GOOD, "CKPT_REPLICA_LISTEN_HOST": " 127.77.0.3 "})
    assert options is not None and options.listen_host == "127.77.0.3"
    options = replica_options_from_env({**GOOD, "CKPT_REPLICA_LISTEN_HOST": "[::1]"})
    assert options is not None and options.listen_host == "::1"


def test_ipv6_peers() -> None:
    options = replica_options_from_env({**GOOD, "CKPT_REPLICA_PEERS": "[fd00::1]:7471"})
    assert options is not None and options.peers == ("[fd00::1]:7471",)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (_without("CKPT_REPLICA_PORT"), "CKPT_REPLICA_PORT is not set"),
        ({**GOOD, "CKPT_REPLICA_PORT": "http"}, "CKPT_REPLICA_PORT='http' is not a TCP port"),
        ({**GOOD, "CKPT_REPLICA_PORT": "0"}, "is not a TCP port"),
        ({**GOOD, "CKPT_REPLICA_PORT": "65536"}, "is not a TCP port"),
        ({**GOOD, "CKPT_REPLICA_PORT": "-1"}, "is not a TCP port"),
        ({**GOOD, "CKPT_REPLICA_PEERS": "job-worker-0"}, "'job-worker-0' is not host:port"),
        ({**GOOD, "CKPT_REPLICA_PEERS": "a:1,b:http"}, "'b:http' is not host:port"),
        ({**GOOD, "CKPT_REPLICA_PEERS": "a:1,a:1"}, "names a peer twice"),
        (_without("CKPT_REPLICA_SECRET_FILE"), "CKPT_REPLICA_SECRET_FILE is not set"),
        (_without("CKPT_REPLICA_JOB"), "CKPT_REPLICA_JOB is not set"),
        ({**GOOD, "CKPT_REPLICA_JOB": "job"}, "CKPT_REPLICA_JOB='job' is not namespace/job"),
        ({**GOOD, "CKPT_REPLICA_JOB": "a/b/c"}, "is not namespace/job"),
        ({**GOOD, "CKPT_REPLICA_JOB": "/job"}, "is not namespace/job"),
        (_without("CKPT_NODE_NAME"), "CKPT_NODE_NAME is not set"),
        ({**GOOD, "CKPT_NODE_NAME": "../etc"}, "CKPT_NODE_NAME='../etc' is not a node name"),
        ({**GOOD, "CKPT_REPLICA_LISTEN_HOST": "a b"}, "CKPT_REPLICA_LISTEN_HOST='a b' is not"),
        ({**GOOD, "CKPT_REPLICA_LISTEN_HOST": "h:1/x"}, "is not an address"),
    ],
)
def test_a_bad_or_missing_value_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ReplicaEnvError, match=message.replace("(", r"\(")):
        replica_options_from_env(env)


def test_a_control_character_is_shown_escaped() -> None:
    with pytest.raises(ReplicaEnvError) as info:
        replica_options_from_env({**GOOD, "CKPT_REPLICA_PORT": "74\x1b[2J71"})
    assert "\x1b" not in str(info.value) and "\\x1b" in str(info.value)


def test_or_off_logs_the_error_and_turns_replication_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ckpt_agent.flash.sidecar.replica_env"):
        assert replicas_or_off({**GOOD, "CKPT_REPLICA_JOB": "job"}) is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "peer replication is off" in errors[0].getMessage()
    assert "CKPT_REPLICA_JOB" in errors[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckpt_agent.flash.sidecar.replica_env"):
        assert replicas_or_off({}) is None
        assert replicas_or_off(GOOD) == replica_options_from_env(GOOD)
    assert not caplog.records  # off, or on with peers: nothing to say


# --------------------------------------------------------------------------- the peer map


def test_the_rank_and_the_map_folder_name_this_pods_file_of_the_peer_map() -> None:
    env = {**GOOD, "CKPT_REPLICA_RANK": "3", "CKPT_REPLICA_PEERS_DIR": "/etc/ckpt-replica-peers"}
    options = replica_options_from_env(env)
    assert options is not None
    assert options.peers_file == "/etc/ckpt-replica-peers/rank-3"
    assert options.peers == ("job-worker-0.ns.svc:7471", "job-worker-1.ns.svc:7471")  # the ring
    assert replica_options_from_env(GOOD) == replace(options, peers_file=None)


@pytest.mark.parametrize(
    ("extra", "logged"),
    [
        ({"CKPT_REPLICA_RANK": "1"}, "CKPT_REPLICA_RANK is set but CKPT_REPLICA_PEERS_DIR is not"),
        ({"CKPT_REPLICA_PEERS_DIR": "/m"}, "CKPT_REPLICA_PEERS_DIR is set but CKPT_REPLICA_RANK"),
        ({"CKPT_REPLICA_RANK": "-1", "CKPT_REPLICA_PEERS_DIR": "/m"}, "is not a rank"),
        ({"CKPT_REPLICA_RANK": "x", "CKPT_REPLICA_PEERS_DIR": "/m"}, "is not a rank"),
    ],
)
def test_a_bad_rank_or_folder_keeps_the_ring_and_replication_on(
    extra: dict[str, str], logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        options = replicas_or_off({**GOOD, **extra})
    assert options is not None and options.peers_file is None
    assert options.peers == ("job-worker-0.ns.svc:7471", "job-worker-1.ns.svc:7471")
    assert logged in caplog.text and "peer map is not read" in caplog.text
