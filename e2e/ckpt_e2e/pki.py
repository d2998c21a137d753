"""Throw-away PKI for a local control plane, generated with ``cryptography`` at start.

Everything is ECDSA P-256 (fast to generate) except the service-account signing key,
which is RSA 2048 (RS256 is what every token consumer expects). Nothing here is
meant to outlive one test session.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = _dt.timedelta(days=7)


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


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


class CertificateAuthority:
    """A self-signed CA that issues serving and client certificates into ``directory``."""

    def __init__(
        self, directory: Path, common_name: str = "ckpt-e2e-ca", filename: str = "ca"
    ) -> None:
        self.directory = directory
        now = _dt.datetime.now(_dt.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self._name = name
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = _write(
            directory / f"{filename}.crt", self._cert.public_bytes(serialization.Encoding.PEM)
        )
        self.key_path = _write(directory / f"{filename}.key", _key_pem(self._key), private=True)

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

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
        now = _dt.datetime.now(_dt.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations or []]
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return CertPair(
            cert=_write(
                self.directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)
            ),
            key=_write(self.directory / f"{name}.key", _key_pem(key), private=True),
        )

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
    return CertPair(
        cert=_write(directory / "sa.pub", pub),
        key=_write(directory / "sa.key", _key_pem(key), private=True),
    )
