"""Server TLS: one policy, certificates reloaded when their files change, and the ASGI TLS
extension.

Policy: TLS 1.2 at least (1.3 is chosen whenever the client has it: OpenSSL picks the highest
common version); TLS 1.2 suites are ECDHE (forward secrecy) with AES-GCM or ChaCha20-Poly1305
only, no CBC, no RSA key exchange; TLS 1.3 suites are the three AEAD ones with AES-128-GCM first
(the server's order wins), unless the OpenSSL configuration (``OPENSSL_CONF``) names its own
``Ciphersuites``. No compression, no renegotiation; ALPN offers HTTP/1.1 only (an ``h2`` client
falls back to it).

Reload without a restart or a dropped connection: the files are stat-ed every second (a
Kubernetes Secret update, how cert-manager rotates, is a swap of the ``..data`` symlink: a new
inode). When they change, a new :class:`ssl.SSLContext` is built from them; the listening
context's SNI callback, which OpenSSL runs for every ClientHello (with or without a server
name), moves each new handshake onto the newest context, and established connections keep
theirs. A version that does not load (a half-written rotation, a key that does not match the
certificate) leaves the previous context in use and is logged once; the next change is tried
again. The client CA file is part of the context, so a rotated client CA is picked up too.

Per record, the event loop calls the connection's ``SSLObject`` (``read``, ``write``,
``pending``), whose methods in Python's ``ssl`` module are one-line wrappers around the C object
that does the work: a Python frame per call, three per request. A server context hands out
objects whose three methods are the C object's own, bound once per connection.
"""

from __future__ import annotations

import datetime
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cryptography import x509

from service.edge import _libssl
from service.fileio import FileStamp, file_stamp
from service.metrics import certificate

log = logging.getLogger("cryptd.tls")

ClientCertMode = Literal["required", "optional"]

TLS12_CIPHERS = ":".join(
    [
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305",
        "ECDHE-RSA-CHACHA20-POLY1305",
    ]
)
ALPN = ["http/1.1"]
# TLS 1.3 suites in the server's order: AES-128-GCM first, as Go and BoringSSL prefer (OpenSSL's
# own order puts AES-256-GCM first); all three are AEAD.
TLS13_SUITES = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
OPENSSL_TLS13_DEFAULT = (
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
    "TLS_AES_128_GCM_SHA256",
)

# For the ASGI TLS extension, which names versions and suites by their IANA numbers.
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}
_CIPHER_IDS = {
    "TLS_AES_128_GCM_SHA256": 0x1301,
    "TLS_AES_256_GCM_SHA384": 0x1302,
    "TLS_CHACHA20_POLY1305_SHA256": 0x1303,
    "ECDHE-ECDSA-AES128-GCM-SHA256": 0xC02B,
    "ECDHE-RSA-AES128-GCM-SHA256": 0xC02F,
    "ECDHE-ECDSA-AES256-GCM-SHA384": 0xC02C,
    "ECDHE-RSA-AES256-GCM-SHA384": 0xC030,
    "ECDHE-RSA-CHACHA20-POLY1305": 0xCCA8,
    "ECDHE-ECDSA-CHACHA20-POLY1305": 0xCCA9,
}


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Where the server's certificate chain and key are, and the CA that client certificates
    must chain to (mutual TLS) with whether a client must present one at the handshake."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    client_cert: ClientCertMode = "required"


class TLSFileError(ValueError):
    """A TLS file that does not load. The message names its setting and path (never its
    content), so that the command can say which file to fix."""


class _ServerContext(ssl.SSLContext):
    """``ssl.SSLContext`` whose connection objects call the C object directly (see the
    module's docstring): ``read(n)``, ``read(n, buffer)``, ``write(data)`` and ``pending()``,
    the positional calls the event loops make, return and raise what the wrappers do."""

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        wrapped = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        inner = getattr(wrapped, "_sslobj", None)  # the wrappers' target, since Python 3.7
        if inner is not None:
            vars(wrapped).update(read=inner.read, write=inner.write, pending=inner.pending)
        return wrapped


def keep_reads_off_mmap() -> None:
    """Make glibc serve the 256 KiB uvloop asks for on every TLS read from the heap.

    uvloop reads each record with ``read(262144)``: CPython allocates a bytes object of that
    size, which glibc maps with mmap (above its 128 KiB threshold), shrinks with mremap to what
    was read and unmaps when it is freed: three system calls per request.
    glibc raises its threshold to the size of the largest mapped block freed (mallopt(3),
    M_MMAP_THRESHOLD, dynamic adjustment), so freeing one 1 MiB block once puts the threshold
    above 256 KiB: the reads then take and give back heap memory, no system call. An operator's
    own M_MMAP_THRESHOLD (MALLOC_MMAP_THRESHOLD_) turns the adjustment off and is kept; other
    C libraries ignore this.
    """
    block = bytearray(1024 * 1024)
    del block


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """A server context with cryptd's policy and ``files`` loaded. Raises
    :class:`TLSFileError` if they do not load (missing, unreadable, not PEM, a key that does
    not match the certificate)."""
    context = _ServerContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    context.options |= (
        ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
    )
    context.set_alpn_protocols(ALPN)
    _prefer_aes128(context)
    keep_reads_off_mmap()  # once per process would do; it costs a microsecond
    cert = f"CRYPTD_TLS_CERT_FILE {files.cert_file}"
    key = f"CRYPTD_TLS_KEY_FILE {files.key_file}"
    if b"-----BEGIN CERTIFICATE-----" not in _read(files.cert_file, cert):
        raise TLSFileError(f"{cert}: no PEM certificate in it")
    key_pem = _read(files.key_file, key)
    if b"PRIVATE KEY-----" not in key_pem:
        raise TLSFileError(f"{key}: no PEM private key in it")
    if b"ENCRYPTED" in key_pem:  # OpenSSL would ask for a passphrase on the terminal
        raise TLSFileError(f"{key}: the key is encrypted; cryptd needs it unencrypted")
    try:
        context.load_cert_chain(files.cert_file, files.key_file)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSFileError(f"{key} does not match the certificate of {cert}") from None
        raise TLSFileError(f"{cert} with {key} does not load ({_reason(exc)})") from None
    except OSError as exc:  # replaced between the read above and this one
        raise TLSFileError(f"{cert} with {key} does not load ({_reason(exc)})") from None
    if files.client_ca_file is not None:
        ca = f"CRYPTD_TLS_CLIENT_CA_FILE {files.client_ca_file}"
        try:
            context.load_verify_locations(cafile=files.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFileError(f"{ca} does not load ({_reason(exc)})") from None
        context.verify_mode = (
            ssl.CERT_REQUIRED if files.client_cert == "required" else ssl.CERT_OPTIONAL
        )
    return context


def _prefer_aes128(context: ssl.SSLContext) -> None:
    """Put AES-128-GCM first among the TLS 1.3 suites, unless the OpenSSL configuration
    (``OPENSSL_CONF``, ``Ciphersuites`` in its ``system_default`` section) set an order of its
    own: then the operator's order stays."""
    tls13 = tuple(c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.3")
    if tls13 != OPENSSL_TLS13_DEFAULT:
        return
    try:
        _libssl.set_tls13_suites(context, TLS13_SUITES)
    except _libssl.LibsslError as exc:
        log.warning("TLS 1.3 suites left in OpenSSL's order", extra={"reason": str(exc)})


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TLSFileError(f"{what}: {_reason(exc)}") from None


def _reason(exc: OSError | ssl.SSLError) -> str:
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else exc.strerror
    return str(reason or type(exc).__name__)


class ServerTLS:
    """The listening context (hand it to the server) and the reload of its files."""

    def __init__(self, files: TLSFiles) -> None:
        """Loads the files now: a configuration that does not load fails here, at start."""
        self.files = files
        self._stamp = self._stamps()
        self.current = server_context(files)
        self.listening = self.current
        self.listening.sni_callback = self._select
        _describe("TLS certificate loaded", files.cert_file)

    def _stamps(self) -> tuple[FileStamp | None, ...]:
        paths = (self.files.cert_file, self.files.key_file, self.files.client_ca_file)
        return tuple(file_stamp(path) for path in paths if path is not None)

    def _select(self, ssl_object: ssl.SSLObject, server_name: str | None, _: Any) -> None:
        current = self.current
        if ssl_object.context is not current:
            ssl_object.context = current

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed; True when a new context is in use."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return False
        self._stamp = stamp  # a version that fails is logged once, not every second
        try:
            context = server_context(self.files)
        except TLSFileError as exc:
            log.error(
                "TLS files changed but do not load; the previous certificate stays in use",
                extra={"reason": str(exc)},
            )
            return False
        self.current = context
        _describe("TLS certificate reloaded", self.files.cert_file)
        return True


@dataclass(frozen=True, slots=True)
class CertificateInfo:
    """What operators need to know of the served certificate (its first in the chain)."""

    subject: str
    dns_names: tuple[str, ...]
    not_after: datetime.datetime  # UTC

    def expired(self, now: datetime.datetime | None = None) -> bool:
        return self.not_after <= (now or datetime.datetime.now(datetime.UTC))

    def fields(self) -> dict[str, str]:
        """For a log line."""
        return {
            "subject": self.subject,
            "dns_names": ",".join(self.dns_names),
            "not_after": self.not_after.isoformat(),
        }


def certificate_info(cert_file: Path) -> CertificateInfo:
    """The subject, DNS names and expiry of the first certificate in ``cert_file``. Raises
    :class:`TLSFileError` if it does not load."""
    what = f"CRYPTD_TLS_CERT_FILE {cert_file}"
    try:
        cert = x509.load_pem_x509_certificate(_read(cert_file, what))
    except ValueError:
        raise TLSFileError(f"{what}: no PEM certificate in it") from None
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = tuple(names.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        dns = ()
    return CertificateInfo(cert.subject.rfc4514_string(), dns, cert.not_valid_after_utc)


def _describe(message: str, cert_file: Path) -> None:
    """Log which certificate is in use (subject, names, expiry), warn when it has expired, and
    give its expiry to the metrics (cryptd_tls_certificate_expiry_seconds)."""
    try:
        info = certificate_info(cert_file)
    except TLSFileError:
        log.info(message)
        return
    certificate.served(info.not_after.timestamp())
    if info.expired():
        log.error(f"{message}, but it has EXPIRED: clients will refuse it", extra=info.fields())
    else:
        log.info(message, extra=info.fields())


@dataclass
class TLSFactory:
    """uvicorn's ``ssl_context_factory``: picklable (the supervisor sends it to every worker),
    it builds the worker's own :class:`ServerTLS` when the worker loads its configuration."""

    files: TLSFiles
    server_tls: ServerTLS | None = None

    def __call__(self, config: object, default: object) -> ssl.SSLContext:
        self.server_tls = ServerTLS(self.files)
        return self.server_tls.listening

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "server_tls": None}  # contexts do not travel


def asgi_tls_extension(ssl_object: ssl.SSLObject) -> dict[str, Any]:
    """``scope["extensions"]["tls"]`` of the ASGI TLS extension, for one connection. The
    client certificate, when there is one, was verified at the handshake."""
    der = ssl_object.getpeercert(binary_form=True)
    chain: list[str] = []
    name = None
    if der:
        chain = [ssl.DER_cert_to_PEM_cert(der)]
        name = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    cipher = ssl_object.cipher()
    return {
        "server_cert": None,
        "client_cert_chain": chain,
        "client_cert_name": name,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": _CIPHER_IDS.get(cipher[0]) if cipher else None,
    }
