"""API clients: who may call cryptd, with which secret, on which keys and operations.

One job (over 400 lines): parsing and validating the clients file, whose every field (secret,
rights, typed certificate identities) is checked here so a bad file is refused whole at start.

The clients file (``CRYPTD_CLIENTS_FILE``) is JSON::

    {"clients": {"billing": {
        "secret": "<base64, >= 32 random bytes>", "admin": false,
        "allow": [{"keys": "billing-*", "operations": ["encrypt", "decrypt"]}],
        "certificates": ["spiffe://example.org/ns/billing/sa/api"]}}}

``certificates`` (mutual TLS) lists the client certificate identities (SAN DNS names or URIs)
the client may present: its signed requests must then arrive over a connection whose
certificate carries one of them. ``"authentication": "certificate"`` makes a client
authenticated by its certificate alone, with no secret and no signature.

A :class:`ClientRegistry` is an immutable snapshot of one version of that file.
:class:`ClientsFile` hands out the current snapshot and swaps in a new one when the file
changes (stat polling, so Kubernetes Secret updates - a symlink swap - are seen too); a file
that does not load leaves the previous snapshot in place. Error messages name the client and
the problem, never the secret.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NoReturn

from service.auth.certs import DNS_PREFIX, URI_PREFIX
from service.fileio import atomic_write, file_stamp

logger = logging.getLogger("cryptd.auth")

OPERATIONS: Final = frozenset(
    {
        "encrypt",
        "decrypt",
        "sign",
        "verify",
        "rewrap",
        "datakey",
        "hmac",
        "random",
        "read",
        "encapsulate",
        "decapsulate",
    }
)
CLIENT_ID_RE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
AUTHENTICATION: Final = ("signature", "certificate")
# A certificate identity: a URI with a scheme (a SPIFFE ID), or a DNS name.
_URI_IDENTITY: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[!-~]{1,2000}")
_DNS_IDENTITY: Final = re.compile(
    r"(?=.{1,253}\Z)(\*\.)?([A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\Z"
)
MIN_SECRET_BYTES: Final = 32
SECRET_BYTES: Final = 32  # what generate_secret() makes
# Random 32-byte secrets have ~31 distinct byte values; fewer than this is not random.
_MIN_DISTINCT_BYTES: Final = 16


class ClientsFileError(ValueError):
    """The clients file cannot be used. The message never contains a secret."""


@dataclass(frozen=True, slots=True)
class AllowRule:
    """Operations allowed on the keys whose names match ``keys`` (an fnmatch glob)."""

    keys: str
    operations: frozenset[str]  # subset of OPERATIONS, or {"*"}
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", re.compile(fnmatch.translate(self.keys)))

    def allows(self, key: str, operation: str) -> bool:
        # "*" matches every name: no regex match on every request for the usual rule.
        return ("*" in self.operations or operation in self.operations) and (
            self.keys == "*" or bool(self._pattern.match(key))
        )

    def to_json(self) -> dict[str, Any]:
        return {"keys": self.keys, "operations": sorted(self.operations)}


@dataclass(frozen=True, slots=True)
class Client:
    """One API client. The secret is the HMAC key (decoded bytes); it never leaves here.
    ``certificates``: the client certificate identities it may present (empty: any, or none);
    ``certificate_only``: authenticated by its certificate alone (it then has no secret)."""

    client_id: str
    secret: bytes = field(repr=False)
    admin: bool = False
    allow: tuple[AllowRule, ...] = ()
    certificates: frozenset[str] = frozenset()
    certificate_only: bool = False

    def allows(self, key: str, operation: str) -> bool:
        """Whether a rule allows ``operation`` on ``key``. Admin does not imply data access."""
        for rule in self.allow:  # noqa: SIM110 - no generator per request
            if rule.allows(key, operation):
                return True
        return False

    def allows_keyless(self, operation: str) -> bool:
        """Whether a rule lists ``operation`` (or ``*``), one that names no key (``random``)."""
        return any("*" in r.operations or operation in r.operations for r in self.allow)

    def __reduce__(self) -> NoReturn:
        # Secrets never travel by accident (to a worker process, a cache, a log handler).
        raise TypeError("Client objects hold a secret and cannot be pickled")


class ClientRegistry:
    """Immutable snapshot of the configured clients."""

    __slots__ = ("_by_certificate", "_clients")

    def __init__(self, clients: Iterable[Client] = ()) -> None:
        self._clients: Mapping[str, Client] = {c.client_id: c for c in clients}
        by_certificate: dict[str, Client] = {}
        for client in self._clients.values():
            if client.certificate_only:
                for identity in client.certificates:
                    other = by_certificate.setdefault(identity, client)
                    if other is not client:
                        raise ClientsFileError(
                            f"clients {other.client_id!r} and {client.client_id!r} are both "
                            f"authenticated by the certificate identity {identity!r}"
                        )
        self._by_certificate: Mapping[str, Client] = by_certificate

    def get(self, client_id: str) -> Client | None:
        return self._clients.get(client_id)

    def secret_for(self, client_id: str) -> bytes | None:
        client = self._clients.get(client_id)
        return None if client is None or client.certificate_only else client.secret

    def by_certificate(self, identities: Iterable[str]) -> Client | None:
        """The certificate-only client these certificate identities authenticate; None when
        they name none, or more than one (a certificate must say who it is unambiguously)."""
        found = {self._by_certificate[i] for i in identities if i in self._by_certificate}
        return found.pop() if len(found) == 1 else None

    def __iter__(self) -> Iterator[Client]:
        return iter(self._clients.values())

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._clients


# --------------------------------------------------------------------------------------------
# Parsing and validation


def generate_secret() -> str:
    """A fresh client secret: 32 bytes from the OS CSPRNG, base64."""
    return base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def decode_secret(client_id: str, text: object) -> bytes:
    """Decode and vet a client secret; errors name the client, never the value."""
    if not isinstance(text, str):
        raise ClientsFileError(f"client {client_id!r}: 'secret' must be a base64 string")
    try:
        secret = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ClientsFileError(f"client {client_id!r}: secret is not valid base64") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ClientsFileError(
            f"client {client_id!r}: secret is {len(secret)} bytes, at least "
            f"{MIN_SECRET_BYTES} random bytes are required"
        )
    # A password or passphrase encoded as base64 is printable text; random bytes are not.
    if len(set(secret)) < _MIN_DISTINCT_BYTES or all(0x20 <= b < 0x7F for b in secret):
        raise ClientsFileError(
            f"client {client_id!r}: secret has too little entropy (it must be random bytes, "
            "e.g. from 'cryptd clients add')"
        )
    return secret


def parse_allow_rule(client_id: str, raw: object) -> AllowRule:
    if not isinstance(raw, Mapping) or set(raw) != {"keys", "operations"}:
        raise ClientsFileError(
            f'client {client_id!r}: each \'allow\' entry is {{"keys": glob, "operations": [...]}}'
        )
    keys, operations = raw["keys"], raw["operations"]
    if not isinstance(keys, str) or not keys:
        raise ClientsFileError(f"client {client_id!r}: 'keys' must be a non-empty glob")
    if (
        not isinstance(operations, list)
        or not operations
        or not all(isinstance(op, str) for op in operations)
    ):
        raise ClientsFileError(f"client {client_id!r}: 'operations' must be a list of names")
    unknown = set(operations) - OPERATIONS - {"*"}
    if unknown:
        raise ClientsFileError(
            f"client {client_id!r}: unknown operation(s) {sorted(unknown)}; "
            f"known: {sorted(OPERATIONS)} or '*'"
        )
    return AllowRule(keys=keys, operations=frozenset(operations))


def parse_certificate_identity(client_id: str, raw: object) -> str:
    """A certificate identity as the clients file lists it, typed as :mod:`service.auth.certs`
    matches it: ``DNS:<name>``, ``URI:<uri>``, or untyped, where a URI with a scheme
    (``spiffe://...``) is a URI SAN and anything else a DNS name. Matched exactly, and only
    against SANs of that type."""
    if isinstance(raw, str):
        if _URI_IDENTITY.fullmatch(raw):
            return URI_PREFIX + raw
        if _DNS_IDENTITY.fullmatch(raw):
            return DNS_PREFIX + raw
        kind, _, value = raw.partition(":")
        if kind.upper() == "URI" and _URI_IDENTITY.fullmatch(value):
            return URI_PREFIX + value
        if kind.upper() == "DNS" and _DNS_IDENTITY.fullmatch(value):
            return DNS_PREFIX + value
    raise ClientsFileError(
        f"client {client_id!r}: certificate identity {raw!r} is neither a URI "
        "(e.g. spiffe://example.org/ns/app/sa/api or URI:spiffe://...) nor a DNS name "
        "(e.g. batch.example.org or DNS:batch.example.org)"
    )


def show_certificate_identity(identity: str) -> str:
    """An identity as a clients file would list it: untyped where that reads back the same
    (every DNS name, a URI with a scheme), typed otherwise."""
    value = identity.partition(":")[2]
    untyped = _URI_IDENTITY.fullmatch(value) or _DNS_IDENTITY.fullmatch(value)
    return value if untyped and parse_certificate_identity("-", value) == identity else identity


def _certificates(client_id: str, raw: Mapping[str, Any]) -> tuple[frozenset[str], bool]:
    listed = raw.get("certificates", [])
    if not isinstance(listed, list):
        raise ClientsFileError(f"client {client_id!r}: 'certificates' must be a list")
    certificates = frozenset(parse_certificate_identity(client_id, i) for i in listed)
    authentication = raw.get("authentication", "signature")
    if authentication not in AUTHENTICATION:
        raise ClientsFileError(
            f"client {client_id!r}: 'authentication' must be 'signature' or 'certificate'"
        )
    certificate_only = authentication == "certificate"
    if certificate_only:
        if not certificates:
            raise ClientsFileError(
                f"client {client_id!r}: authentication by certificate needs 'certificates'"
            )
        if "secret" in raw:
            raise ClientsFileError(
                f"client {client_id!r}: a client authenticated by certificate has no 'secret'"
            )
    elif "secret" not in raw:
        raise ClientsFileError(f"client {client_id!r}: 'secret' is missing")
    return certificates, certificate_only


def parse_client(client_id: object, raw: object) -> Client:
    if not isinstance(client_id, str) or not CLIENT_ID_RE.fullmatch(client_id):
        raise ClientsFileError(f"client id {client_id!r} must match [A-Za-z0-9_.-]{{1,64}}")
    if not isinstance(raw, Mapping):
        raise ClientsFileError(f"client {client_id!r}: entry must be an object")
    unknown = set(raw) - {"secret", "admin", "allow", "certificates", "authentication"}
    if unknown:
        raise ClientsFileError(f"client {client_id!r}: unknown field(s) {sorted(unknown)}")
    certificates, certificate_only = _certificates(client_id, raw)
    admin = raw.get("admin", False)
    if not isinstance(admin, bool):
        raise ClientsFileError(f"client {client_id!r}: 'admin' must be true or false")
    allow = raw.get("allow", [])
    if not isinstance(allow, list):
        raise ClientsFileError(f"client {client_id!r}: 'allow' must be a list")
    return Client(
        client_id=client_id,
        secret=b"" if certificate_only else decode_secret(client_id, raw["secret"]),
        admin=admin,
        allow=tuple(parse_allow_rule(client_id, rule) for rule in allow),
        certificates=certificates,
        certificate_only=certificate_only,
    )


def parse_clients(document: object) -> ClientRegistry:
    if not isinstance(document, Mapping) or not isinstance(document.get("clients"), Mapping):
        raise ClientsFileError('clients file must be {"clients": {"<id>": {...}}}')
    return ClientRegistry(parse_client(cid, raw) for cid, raw in document["clients"].items())


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, value in pairs:
        if name in result:
            # Two entries for one client: which secret is meant is anyone's guess.
            raise ClientsFileError(f"duplicate key {name!r} in clients file")
        result[name] = value
    return result


def read_document(path: Path) -> dict[str, Any]:
    """Read the clients file as JSON, refusing duplicate keys."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClientsFileError(f"clients file {path} does not exist") from None
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as exc:
        # Position only: the message of a JSON error may quote the text around it.
        raise ClientsFileError(
            f"clients file {path} is not valid JSON (line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(document, dict):
        raise ClientsFileError(f"clients file {path} must hold a JSON object")
    return document


def load_registry(path: Path) -> ClientRegistry:
    """Load and validate the clients file; raise :class:`ClientsFileError` if unusable."""
    try:
        return parse_clients(read_document(path))
    except ClientsFileError as exc:
        raise ClientsFileError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Hot reload


class ClientsFile:
    """The current :class:`ClientRegistry` for a clients file, reloaded when the file changes.

    Call the instance (it is a ``registry_provider``): at most every ``interval`` seconds it
    stats the file and, if inode, times or size changed, loads it. A file that fails to load
    is logged (without secrets) and the previous registry stays in force.
    """

    def __init__(self, path: Path, *, interval: float = 1.0) -> None:
        self.path = path
        self.interval = interval
        self._lock = threading.Lock()
        self._stat = file_stamp(path)
        self._registry = load_registry(path)  # the first load must succeed
        self._checked_at = time.monotonic()

    def __call__(self) -> ClientRegistry:
        if time.monotonic() - self._checked_at >= self.interval:
            self.reload_if_changed()
        return self._registry

    @property
    def registry(self) -> ClientRegistry:
        return self._registry

    def reload_if_changed(self) -> bool:
        """Reload if the file changed since the last look; return whether a new one loaded."""
        with self._lock:
            self._checked_at = time.monotonic()
            stat = file_stamp(self.path)
            if stat == self._stat:
                return False
            self._stat = stat  # remember even a bad version: log it once, not every second
            if stat is None:
                logger.error("clients file %s is missing; keeping the previous clients", self.path)
                return False
            try:
                registry = load_registry(self.path)
            except (ClientsFileError, OSError) as exc:
                logger.error("clients file not reloaded, keeping the previous clients: %s", exc)
                return False
            self._registry = registry
            logger.info("clients file %s reloaded: %d client(s)", self.path, len(registry))
            return True


# --------------------------------------------------------------------------------------------
# Editing (the `cryptd clients` command)


def write_document(path: Path, document: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically (mode 0600): see :func:`service.fileio.atomic_write`."""
    atomic_write(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def parse_allow_spec(spec: str) -> dict[str, Any]:
    """``'glob:op1,op2'`` from the command line to an allow rule (validated)."""
    keys, sep, ops = spec.rpartition(":")
    if not sep or not keys or not ops:
        raise ClientsFileError(f"--allow {spec!r}: expected 'GLOB:OP[,OP...]'")
    rule = {"keys": keys, "operations": [op.strip() for op in ops.split(",") if op.strip()]}
    parse_allow_rule("<new>", rule)
    return rule
