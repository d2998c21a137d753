"""Peer replication from the environment the webhook sets (``ckpt sidecar``; docs/replicas.md).

:func:`replica_options_from_env` turns the ``CKPT_REPLICA_*`` variables
(:mod:`ckpt_agent.policy.replica_contract`) and ``CKPT_NODE_NAME`` (the downward API's
``spec.nodeName``) into :class:`~ckpt_agent.flash.replica.replicator.ReplicaOptions`:

* none of ``CKPT_REPLICA_PORT``, ``CKPT_REPLICA_PEERS``, ``CKPT_REPLICA_SECRET_FILE`` set:
  replication is off (None), as for every policy that does not ask for it;
* some set: every value is checked here and a malformed or missing one raises
  :class:`ReplicaEnvError` naming the variable; the sidecar logs it and persists without
  replication (the CLI's :func:`replicas_or_off`). The secret file itself is read when the
  replication starts (:class:`~ckpt_agent.flash.replica.replicator.Replicator`): a missing
  or unreadable one is logged there, with a ``replication_off`` event.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.format.layout import is_run_id
from ckpt_agent.policy.agent_config import ENV_NODE_NAME
from ckpt_agent.policy.replica_contract import (
    ENV_REPLICA_JOB,
    ENV_REPLICA_PEERS,
    ENV_REPLICA_PORT,
    ENV_REPLICA_SECRET_FILE,
)
from ckpt_agent.text import clean

__all__ = ["ReplicaEnvError", "replica_options_from_env", "replicas_or_off"]

log = logging.getLogger(__name__)

_SWITCHES = (ENV_REPLICA_PORT, ENV_REPLICA_PEERS, ENV_REPLICA_SECRET_FILE)


class ReplicaEnvError(ValueError):
    """A ``CKPT_REPLICA_*`` variable (or ``CKPT_NODE_NAME``) is missing or malformed."""


def _get(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def _shown(value: str) -> str:
    return repr(clean(value, 80))


def _required(env: Mapping[str, str], name: str, what: str) -> str:
    value = _get(env, name)
    if not value:
        raise ReplicaEnvError(f"{name} is not set: {what}")
    return value


def _port(env: Mapping[str, str]) -> int:
    raw = _required(env, ENV_REPLICA_PORT, "the port this sidecar serves its peers on")
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ReplicaEnvError(
            f"{ENV_REPLICA_PORT}={_shown(raw)} is not a TCP port (a number in 1..65535)"
        )
    return int(raw)


def _peers(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = _get(env, ENV_REPLICA_PEERS)
    peers: list[str] = []
    for item in (p.strip() for p in raw.split(",")):
        if not item:
            continue
        try:
            peers.append(str(Peer.parse(item)))
        except ValueError:
            raise ReplicaEnvError(
                f"{ENV_REPLICA_PEERS}: {_shown(item)} is not host:port ([v6]:port for IPv6); "
                "expected a comma-separated list of the peer sidecars"
            ) from None
    if len(set(peers)) != len(peers):
        raise ReplicaEnvError(f"{ENV_REPLICA_PEERS}={_shown(raw)} names a peer twice")
    return tuple(peers)


def _job(env: Mapping[str, str]) -> tuple[str, str]:
    raw = _required(env, ENV_REPLICA_JOB, "namespace/job, the job the peers must belong to")
    namespace, sep, job = raw.partition("/")
    if not sep or not namespace or not job or "/" in job:
        raise ReplicaEnvError(f"{ENV_REPLICA_JOB}={_shown(raw)} is not namespace/job")
    return namespace, job


def _node(env: Mapping[str, str]) -> str:
    node = _required(
        env, ENV_NODE_NAME, "this node's name (the downward API's spec.nodeName) names its replicas"
    )
    if not is_run_id(node):
        raise ReplicaEnvError(
            f"{ENV_NODE_NAME}={_shown(node)} is not a node name (letters, digits, '.', '_', '-')"
        )
    return node


def replica_options_from_env(environ: Mapping[str, str] | None = None) -> ReplicaOptions | None:
    """The replication the webhook switched on (see the module doc); None: off."""
    env = os.environ if environ is None else environ
    if not any(_get(env, name) for name in _SWITCHES):
        return None
    port = _port(env)
    peers = _peers(env)
    secret_file = _required(env, ENV_REPLICA_SECRET_FILE, "the mounted per-job replica secret")
    namespace, job = _job(env)
    return ReplicaOptions(
        node=_node(env),
        namespace=namespace,
        job_id=job,
        secret_file=secret_file,
        peers=peers,
        listen_port=port,
    )


def replicas_or_off(environ: Mapping[str, str] | None = None) -> ReplicaOptions | None:
    """:func:`replica_options_from_env`, a bad value logged as an error and replication off
    (the sidecar still persists: checkpoints never depend on the peers)."""
    try:
        options = replica_options_from_env(environ)
    except ReplicaEnvError as e:
        log.error("peer replication is off: %s (fix the pod's environment)", clean(e))
        return None
    if options is not None and not options.peers:
        log.info(
            "peer replication: no peers to push to (%s is empty); serving peers on port %d",
            ENV_REPLICA_PEERS,
            options.listen_port,
        )
    return options
