"""Certificates for development (``cryptd serve --dev --tls``) and tests: a private CA and
the leaf certificates it issues (pyca/cryptography x509, ECDSA P-256 keys).

Never for production: the CA key sits next to the certificates, unencrypted (mode 0600).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from service.fileio import atomic_write

CA_DAYS = 3650
LEAF_DAYS = 90
RENEW_BEFORE = datetime.timedelta(days=7)
DEV_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(common_name: str, *, days: int = CA_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    """Digital signatures (ECDSA), and certificates and CRLs for a CA; nothing else."""
    usages = dict.fromkeys(_KEY_USAGES, False)
    usages.update(digital_signature=True, key_cert_sign=signs_certificates)
    usages["crl_sign"] = signs_certificates
    return x509.KeyUsage(**usages)


_KEY_USAGES = (
    "digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
    "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only",
)  # fmt: skip


def _general_name(value: str) -> x509.GeneralName:
    if "://" in value:
        return x509.UniformResourceIdentifier(value)
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        return x509.DNSName(value)


def issue(
    ca: Issued,
    names: Iterable[str],
    *,
    common_name: str | None = None,
    server: bool = True,
    client: bool = False,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> Issued:
    """A leaf certificate from ``ca`` for ``names`` (DNS names, IP addresses, or URIs such as
    SPIFFE IDs, told apart by their form)."""
    names = list(names)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    subject = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, common_name or (names[0] if names else "cryptd"))]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False
        )
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


@dataclass(frozen=True, slots=True)
class DevTLS:
    ca_file: Path
    cert_file: Path
    key_file: Path


def _load(cert_path: Path, key_path: Path) -> Issued | None:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    return Issued(cert, key)


def _covers(cert: x509.Certificate, hosts: Iterable[str]) -> bool:
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    present = {str(n.value) for n in names}
    return all(str(_general_name(host).value) in present for host in hosts)


def ensure_dev_tls(directory: Path, hosts: Iterable[str] = ()) -> DevTLS:
    """The development CA and server certificate in ``directory/tls/``: made once, the server
    certificate made again when it lacks one of ``hosts`` or expires within a week."""
    tls = directory / "tls"
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_file, ca_key = tls / "ca.crt", tls / "ca.key"
    cert_file, key_file = tls / "server.crt", tls / "server.key"
    wanted = list(dict.fromkeys([*DEV_HOSTS, *hosts]))
    ca = _load(ca_file, ca_key)
    if ca is None:
        ca = make_ca("cryptd development CA")
        atomic_write(ca_key, ca.key_pem())
        atomic_write(ca_file, ca.cert_pem(), mode=0o644)
    leaf = _load(cert_file, key_file)
    if (
        leaf is None
        or leaf.cert.issuer != ca.cert.subject
        or leaf.cert.not_valid_after_utc - RENEW_BEFORE < _now()
        or not _covers(leaf.cert, wanted)
    ):
        leaf = issue(ca, wanted, common_name="cryptd development server")
        atomic_write(key_file, leaf.key_pem())
        atomic_write(cert_file, leaf.cert_pem(), mode=0o644)
    return DevTLS(ca_file.resolve(), cert_file.resolve(), key_file.resolve())
