"""Authenticating a replica connection to one job: a challenge–response over the job's secret.

Before anything else on a connection, both sides prove they hold the job's secret (the
Secret ``ckpt-replica-<job>``), *for this namespace and job id*::

    client → server   hello  {namespace, job, nonce_c}
    server → client   hello  {namespace, job, nonce_s,
                              proof = HMAC(secret, nonce_c ‖ ns ‖ job ‖ "server")}
    client → server   proof  {proof = HMAC(secret, nonce_s ‖ ns ‖ job ‖ "client")}
    server → client   ok
    … every later frame tagged under HMAC(secret, "session" ‖ nonce_c ‖ nonce_s ‖ ns ‖ job)

HMAC-SHA256, 32-byte random nonces, compared in constant time (:func:`hmac.compare_digest`).
The role is part of what is signed, so one side's answer can never be replayed as the
other's; the namespace and job id are too, so a peer of another job (another secret, or
the same secret under another job id) is refused, and both sides say why. A side that
refuses sends an ``error`` frame before closing, so the other side's error is clear too.
The handshake runs under :data:`~.wire.HANDSHAKE_LIMITS` (4 KiB headers, no payload): an
unauthenticated peer cannot make this side allocate more.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NoReturn

from ckpt_agent.errors import ReplicaAuthError, ReplicaError
from ckpt_agent.flash.replica.wire import Conn
from ckpt_agent.format.layout import validate_run_id

__all__ = ["MIN_SECRET_BYTES", "PROTOCOL_VERSION", "JobScope", "accept", "connect_as_client"]

PROTOCOL_VERSION: Final = 1
MIN_SECRET_BYTES: Final = 16
_NONCE_BYTES: Final = 32
_DOMAIN: Final = b"ckpt-operator.replica/v1"
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class JobScope:
    """Whose replicas a connection may carry: one job of one namespace, and its secret."""

    namespace: str
    job_id: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(
                f"invalid namespace {self.namespace!r}: a Kubernetes namespace is a DNS label "
                "(lowercase letters, digits and '-', at most 63 characters)"
            )
        validate_run_id(self.job_id)
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the replica secret has {len(self.secret)} bytes; use at least "
                f"{MIN_SECRET_BYTES} random bytes (docs/replicas.md: 32)"
            )

    @classmethod
    def from_file(cls, namespace: str, job_id: str, path: str | Path) -> JobScope:
        """The scope with the secret read from ``path`` (a mounted Secret; surrounding
        whitespace stripped)."""
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"cannot read the replica secret {path}: {e}") from None
        return cls(namespace, job_id, raw)

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.job_id}"

    def proof(self, nonce: bytes, role: str) -> str:
        msg = b"\0".join(
            (_DOMAIN, nonce, self.namespace.encode(), self.job_id.encode(), role.encode())
        )
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def session_key(self, client_nonce: bytes, server_nonce: bytes) -> bytes:
        """The key that tags the rest of one connection (:meth:`~.wire.Conn.bind`): fresh per
        connection (both nonces), bound to the scope, never sent."""
        msg = b"\0".join(
            (
                _DOMAIN,
                b"session",
                client_nonce,
                server_nonce,
                self.namespace.encode(),
                self.job_id.encode(),
            )
        )
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def check(self, nonce: bytes, role: str, proof: object) -> bool:
        return isinstance(proof, str) and hmac.compare_digest(
            self.proof(nonce, role).encode(), proof.encode("ascii", "replace")
        )


def connect_as_client(conn: Conn, scope: JobScope) -> None:
    """Authenticate ``conn`` (just connected) as the client; raises :class:`ReplicaAuthError`
    when the peer is not this job's (after telling it why)."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    conn.send(_hello(scope, nonce))
    hello = conn.expect("hello")
    theirs = _scope_of(conn, hello.header)
    if theirs != scope.label:
        _refuse(conn, f"the peer {conn.peer} serves job {theirs}, this side is of {scope.label}")
    if not scope.check(nonce, "server", hello.header.get("proof")):
        _refuse(
            conn,
            f"the peer {conn.peer} did not prove it holds the replica secret of {scope.label} "
            "(HMAC mismatch: another job's peer, or a stale secret)",
        )
    server_nonce = _nonce(conn, hello.header)
    conn.send({"t": "proof", "proof": scope.proof(server_nonce, "client")})
    conn.expect("ok")
    conn.bind(scope.session_key(nonce, server_nonce), "client")


def accept(conn: Conn, scope: JobScope) -> None:
    """Authenticate ``conn`` (just accepted) as the server; raises :class:`ReplicaAuthError`
    when the client is not this job's (after telling it why)."""
    hello = conn.expect("hello")
    if hello.header.get("v") != PROTOCOL_VERSION:
        conn.send_error(f"replica protocol version {hello.header.get('v')!r} is not supported")
        raise ReplicaError(
            f"replica client {conn.peer}: protocol version {hello.header.get('v')!r} "
            f"(this side speaks {PROTOCOL_VERSION}); refused"
        )
    theirs = _scope_of(conn, hello.header)
    if theirs != scope.label:
        _refuse(
            conn,
            f"the client {conn.peer} is of job {theirs}, this peer replicates {scope.label}: "
            "a pod of another job or namespace cannot read or write these replicas",
        )
    nonce = secrets.token_bytes(_NONCE_BYTES)
    client_nonce = _nonce(conn, hello.header)
    answer = scope.proof(client_nonce, "server")
    conn.send({**_hello(scope, nonce), "proof": answer})
    proof = conn.expect("proof")
    if not scope.check(nonce, "client", proof.header.get("proof")):
        _refuse(
            conn,
            f"the client {conn.peer} did not prove it holds the replica secret of "
            f"{scope.label} (HMAC mismatch: another job's pod, or a stale secret)",
        )
    conn.send({"t": "ok"})
    conn.bind(scope.session_key(client_nonce, nonce), "server")


def _hello(scope: JobScope, nonce: bytes) -> dict[str, object]:
    return {
        "t": "hello",
        "v": PROTOCOL_VERSION,
        "namespace": scope.namespace,
        "job": scope.job_id,
        "nonce": nonce.hex(),
    }


def _scope_of(conn: Conn, header: dict[str, object]) -> str:
    ns, job = header.get("namespace"), header.get("job")
    if not isinstance(ns, str) or not isinstance(job, str):
        _refuse(conn, f"the peer {conn.peer} sent a hello without namespace and job")
    return f"{str(ns)[:63]}/{str(job)[:253]}"


def _nonce(conn: Conn, header: dict[str, object]) -> bytes:
    raw = header.get("nonce")
    if not isinstance(raw, str) or len(raw) != 2 * _NONCE_BYTES or not _HEX.fullmatch(raw):
        _refuse(conn, f"the peer {conn.peer} sent a malformed nonce")
    return bytes.fromhex(str(raw))


def _refuse(conn: Conn, why: str) -> NoReturn:
    err = ReplicaAuthError(f"replica connection refused: {why}")
    conn.send_error(err)
    raise err
