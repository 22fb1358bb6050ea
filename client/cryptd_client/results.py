"""What the methods return: the wire's fields with their wire types (binary fields as bytes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EncryptResult:
    ciphertext: str
    key_version: int


@dataclass(frozen=True, slots=True)
class DecryptResult:
    plaintext: bytes = field(repr=False)
    key_version: int


@dataclass(frozen=True, slots=True)
class SignResult:
    signature: bytes
    key_version: int


@dataclass(frozen=True, slots=True)
class MacResult:
    mac: str
    key_version: int


@dataclass(frozen=True, slots=True)
class DataKey:
    plaintext: bytes = field(repr=False)
    ciphertext: str
    key_version: int


@dataclass(frozen=True, slots=True)
class Encapsulation:
    """A KEM encapsulation (ML-KEM, X-Wing): the ciphertext to send to the key's owner and
    the shared secret it yields (``decapsulate`` gives the owner the same secret)."""

    ciphertext: bytes
    shared_secret: bytes = field(repr=False)
    key_version: int


@dataclass(frozen=True, slots=True)
class SharedSecret:
    shared_secret: bytes = field(repr=False)
    key_version: int


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """A version's usage (``get_key``): successful operations by kind (``encrypt``,
    ``decrypt``, ``sign``, ``verify``, ``hmac``, ``datakey``, ``rewrap_from``, ``rewrap_to``),
    their total, and the latest use (RFC 3339; None: never)."""

    operations: Mapping[str, int]
    total: int
    last_used_at: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> KeyUsage | None:
        if data is None:
            return None
        operations = {str(k): int(v) for k, v in data.get("operations", {}).items()}
        return cls(
            operations=operations,
            total=int(data.get("total", sum(operations.values()))),
            last_used_at=data.get("last_used_at"),
        )


@dataclass(frozen=True, slots=True)
class KeyVersion:
    version: int
    created_at: str | None = None
    public_key_pem: str | None = None
    public_key_raw: str | None = None
    usage: KeyUsage | None = None  # None: not sent (a key list) or unreadable on the server


@dataclass(frozen=True, slots=True)
class KeyMetadata:
    """A key's metadata. ``versions`` is filled by ``get_key`` (public keys only); fields this
    version of the client does not know are in ``raw``."""

    name: str
    type: str
    latest_version: int
    min_decryption_version: int
    created_at: str | None = None
    deletion_allowed: bool | None = None
    derived: bool = False
    convergent: bool = False
    state: str = "enabled"  # enabled | decrypt_only | disabled | pending_deletion
    min_encryption_version: int = 0
    auto_rotate_period: int = 0
    deletion_date: str | None = None  # while pending_deletion
    versions: tuple[KeyVersion, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KeyMetadata:
        return cls(
            name=data["name"],
            type=data["type"],
            latest_version=int(data["latest_version"]),
            min_decryption_version=int(data["min_decryption_version"]),
            created_at=data.get("created_at"),
            deletion_allowed=data.get("deletion_allowed"),
            derived=bool(data.get("derived", False)),
            convergent=bool(data.get("convergent", False)),
            state=str(data.get("state", "enabled")),
            min_encryption_version=int(data.get("min_encryption_version", 0)),
            auto_rotate_period=int(data.get("auto_rotate_period", 0)),
            deletion_date=data.get("deletion_date"),
            versions=tuple(
                KeyVersion(
                    version=int(v["version"]),
                    created_at=v.get("created_at"),
                    public_key_pem=v.get("public_key_pem"),
                    public_key_raw=v.get("public_key_raw"),
                    usage=KeyUsage.from_json(v.get("usage")),
                )
                for v in data.get("versions", ())
            ),
            raw=dict(data),
        )
