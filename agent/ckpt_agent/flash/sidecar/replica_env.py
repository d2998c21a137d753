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
  or unreadable one is logged there, with a ``replication_off`` event;
* ``CKPT_REPLICA_RANK`` and ``CKPT_REPLICA_PEERS_DIR`` (both, or neither): this pod's file of
  the operator's peer map, ``<dir>/rank-<r>``, read while the sidecar runs
  (:class:`~ckpt_agent.flash.replica.peer_map.PeerMap`); the peers of
  ``CKPT_REPLICA_PEERS`` (the ring) until it is there. A malformed or lone one is logged
  and the sidecar keeps to the ring: the map only places the replicas better. The file is
  read every ``CKPT_REPLICA_PEERS_REFRESH_S`` seconds (default 10; a bad value: the default).
* ``CKPT_REPLICA_LISTEN_HOST``: the address to serve the peers on (default ``0.0.0.0``;
  not set by the webhook).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ckpt_agent.flash.replica.peer_map import DEFAULT_REFRESH_S, parse_peers
from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.format.layout import is_run_id
from ckpt_agent.policy.agent_config import ENV_NODE_NAME
from ckpt_agent.policy.replica_contract import (
    ENV_REPLICA_JOB,
    ENV_REPLICA_LISTEN_HOST,
    ENV_REPLICA_PEERS,
    ENV_REPLICA_PEERS_DIR,
    ENV_REPLICA_PEERS_REFRESH_S,
    ENV_REPLICA_PORT,
    ENV_REPLICA_RANK,
    ENV_REPLICA_SECRET_FILE,
    peers_map_key,
)
from ckpt_agent.text import clean

__all__ = ["ReplicaEnvError", "replica_options_from_env", "replicas_or_off"]

log = logging.getLogger(__name__)

#: Where the sidecar serves its peers unless ``CKPT_REPLICA_LISTEN_HOST`` says otherwise.
DEFAULT_LISTEN_HOST = "0.0.0.0"

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
    try:
        return tuple(str(p) for p in parse_peers(_get(env, ENV_REPLICA_PEERS), ENV_REPLICA_PEERS))
    except ValueError as e:
        raise ReplicaEnvError(str(e)) from None


def _peers_file(env: Mapping[str, str]) -> str | None:
    """This pod's file of the peer map (None: no map). Raises ReplicaEnvError for a lone
    or malformed ``CKPT_REPLICA_RANK`` / ``CKPT_REPLICA_PEERS_DIR``."""
    rank, folder = _get(env, ENV_REPLICA_RANK), _get(env, ENV_REPLICA_PEERS_DIR)
    if not rank and not folder:
        return None
    if not rank or not folder:
        given, missing = (
            (ENV_REPLICA_RANK, ENV_REPLICA_PEERS_DIR)
            if rank
            else (ENV_REPLICA_PEERS_DIR, ENV_REPLICA_RANK)
        )
        raise ReplicaEnvError(f"{given} is set but {missing} is not")
    if not rank.isdigit() or len(rank) > 9:
        raise ReplicaEnvError(f"{ENV_REPLICA_RANK}={_shown(rank)} is not a rank (a number >= 0)")
    return os.path.join(folder, peers_map_key(int(rank)))


def _refresh_s(env: Mapping[str, str]) -> float:
    raw = _get(env, ENV_REPLICA_PEERS_REFRESH_S)
    if not raw:
        return DEFAULT_REFRESH_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        log.error("%s=%s is not a number of seconds in (0, 3600]; reading the peer map every "
                  "%g s", ENV_REPLICA_PEERS_REFRESH_S, _shown(raw), DEFAULT_REFRESH_S)  # fmt: skip
        return DEFAULT_REFRESH_S
    return value


def _listen_host(env: Mapping[str, str]) -> str:
    host = _get(env, ENV_REPLICA_LISTEN_HOST)
    if not host:
        return DEFAULT_LISTEN_HOST
    if any(c.isspace() or c in "/,@" for c in host) or len(host) > 253:
        raise ReplicaEnvError(f"{ENV_REPLICA_LISTEN_HOST}={_shown(host)} is not an address")
    return host.removeprefix("[").removesuffix("]")


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
    try:
        peers_file = _peers_file(env)
    except ReplicaEnvError as e:
        log.error(
            "the operator's peer map is not read: %s; pushing to %s", clean(e), ENV_REPLICA_PEERS
        )
        peers_file = None
    return ReplicaOptions(
        node=_node(env),
        namespace=namespace,
        job_id=job,
        secret_file=secret_file,
        peers=peers,
        peers_file=peers_file,
        peers_refresh_s=_refresh_s(env),
        listen_host=_listen_host(env),
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
