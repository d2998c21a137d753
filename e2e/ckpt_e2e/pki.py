"""Throw-away PKI for a local control plane, generated with ``cryptography`` at start.

The certificates are built by the operator's :mod:`ckpt_operator.adapters.certs` (one home
for certificate building); this module only names them and writes the PEM files.
Everything is ECDSA P-256 (fast to generate) except the service-account signing key,
which is RSA 2048 (RS256 is what every token consumer expects). Nothing here is
meant to outlive one test session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from ckpt_operator.adapters.certs import KeyPair, generate_ca, issue_cert, pem_private_key

_VALIDITY_DAYS = 7


@dataclass(frozen=True)
class CertPair:
    """PEM files of one certificate and its private key."""

    cert: Path
    key: Path


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _write_pair(directory: Path, name: str, cert: bytes, key: bytes, *, cert_ext: str) -> CertPair:
    return CertPair(
        cert=_write(directory / f"{name}.{cert_ext}", cert),
        key=_write(directory / f"{name}.key", key, private=True),
    )


class CertificateAuthority:
    """A self-signed CA that issues serving and client certificates into ``directory``."""

    def __init__(
        self, directory: Path, common_name: str = "ckpt-e2e-ca", filename: str = "ca"
    ) -> None:
        self.directory = directory
        self._pair: KeyPair = generate_ca(common_name, days=_VALIDITY_DAYS)
        files = _write_pair(
            directory, filename, self._pair.cert_pem, self._pair.key_pem, cert_ext="crt"
        )
        self.cert_path, self.key_path = files.cert, files.key

    @property
    def cert_pem(self) -> bytes:
        return self._pair.cert_pem

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: list[str] | None = None,
        hosts: list[str] | None = None,
        server: bool = False,
        client: bool = False,
    ) -> CertPair:
        """Issue ``<name>.crt``/``<name>.key``. ``hosts`` become SANs (IPs or DNS names)."""
        leaf = issue_cert(
            self._pair,
            common_name,
            sans=hosts or (),
            organizations=organizations or (),
            server=server,
            client=client,
            days=_VALIDITY_DAYS,
        )
        return _write_pair(self.directory, name, leaf.cert_pem, leaf.key_pem, cert_ext="crt")

    def serving_cert(self, name: str, hosts: list[str]) -> CertPair:
        """A TLS server certificate for ``hosts`` (e.g. a webhook on 127.0.0.1)."""
        return self.issue(name, common_name=hosts[0], hosts=hosts, server=True)

    def client_cert(self, name: str, user: str, groups: list[str] | None = None) -> CertPair:
        """A client certificate: the API server maps CN to the user and O to its groups."""
        return self.issue(name, common_name=user, organizations=groups, client=True)


def service_account_keys(directory: Path) -> CertPair:
    """RSA key pair for signing service-account tokens: ``sa.key`` and ``sa.pub``."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _write_pair(directory, "sa", pub, pem_private_key(key), cert_ext="pub")
