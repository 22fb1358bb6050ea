"""The keyring: named keys with numbered versions, parsed once and held as an immutable snapshot.

The keyring owns versions (latest, ``min_decryption_version``) and the token framing, so every
check on a version happens here, before any cipher runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType

from service.crypto import derived as derivation
from service.crypto.base import KeyHandle, KeyType
from service.errors import InvalidRequest, KeyNotFound

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")


def check_key_name(name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidRequest("key name must match [A-Za-z0-9_.-]{1,128} and not be '.' or '..'")
    return name


def load_handle(
    key_type: KeyType,
    material: bytes,
    *,
    name: str,
    version: int,
    derived: bool = False,
    convergent: bool = False,
) -> KeyHandle:
    """Parse one version's (authenticated) material; a derived key's handle derives a key per
    context, bound to this name, version and type."""
    if not derived:
        return key_type.load(material)
    if key_type.derive is None:
        raise ValueError(f"key type {key_type.name} cannot be derived")
    binding = derivation.binding(key_type.type_id, name, version)
    return key_type.derive(material, binding, convergent)


def check_key_flags(key_type: KeyType, *, derived: bool, convergent: bool) -> None:
    """Refuse (400) flags the type cannot have."""
    if derived and key_type.derive is None:
        raise InvalidRequest(f"key type {key_type.name} cannot be derived")
    if convergent and not derived:
        raise InvalidRequest("'convergent' needs 'derived': true")
    if convergent and not key_type.convergent:
        raise InvalidRequest(f"key type {key_type.name} cannot be convergent")


@dataclass(frozen=True, slots=True)
class KeyVersion:
    version: int
    created_at: str
    handle: KeyHandle = field(repr=False)

    @property
    def created_ts(self) -> float:
        return (
            datetime.strptime(self.created_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        )


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    type: KeyType
    created_at: str
    min_decryption_version: int
    deletion_allowed: bool
    versions: Mapping[int, KeyVersion]
    activation_delay: float = 0.0
    derived: bool = False  # every operation takes a context (a key per context, HKDF)
    convergent: bool = False  # derived encryption with a deterministic nonce

    def active_version(self, now: float | None = None) -> int:
        """The version new encryptions and signatures use: the newest one older than the
        activation delay. Replicas reload a rotated keyring at different moments (a Kubernetes
        Secret reaches each pod within the kubelet's sync period); the delay lets every replica
        hold a version before any replica writes with it. Decryption accepts every version."""
        latest = max(self.versions)
        if self.activation_delay <= 0:
            return latest
        cutoff = (time.time() if now is None else now) - self.activation_delay
        active = [v for v, kv in self.versions.items() if kv.created_ts <= cutoff]
        return max(active) if active else min(self.versions)

    @property
    def latest_version(self) -> int:
        return max(self.versions)

    def version(self, requested: int | None = None) -> KeyVersion:
        """The version to use: the latest by default. Refuses versions below 1 or below
        ``min_decryption_version`` (400) and versions that do not exist (404)."""
        if requested is None:
            requested = max(self.active_version(), self.min_decryption_version)
        if requested < 1:
            raise InvalidRequest("key_version must be 1 or more")
        if requested < self.min_decryption_version:
            raise InvalidRequest(
                f"key version {requested} is below min_decryption_version "
                f"{self.min_decryption_version}"
            )
        found = self.versions.get(requested)
        if found is None:
            raise KeyNotFound(f"key {self.name!r} has no version {requested}")
        return found

    def metadata(self) -> dict[str, object]:
        return {
            "name": self.name,
            "type": self.type.name,
            "created_at": self.created_at,
            "latest_version": self.latest_version,
            "min_decryption_version": self.min_decryption_version,
            "deletion_allowed": self.deletion_allowed,
            "derived": self.derived,
            "convergent": self.convergent,
        }

    def describe(self) -> dict[str, object]:
        """Metadata with every version's public key (never private or secret material)."""
        versions = []
        for number in sorted(self.versions):
            entry: dict[str, object] = {
                "version": number,
                "created_at": self.versions[number].created_at,
            }
            handle = self.versions[number].handle
            pem = handle.public_key_pem()
            if pem is not None:
                entry["public_key_pem"] = pem
            raw = handle.public_key_raw()
            if raw is not None:
                entry["public_key_raw"] = raw
            versions.append(entry)
        return {**self.metadata(), "versions": versions}


class Keyring(Mapping[str, Key]):
    """Immutable snapshot of every key, identified by ``generation`` (a digest of the file)."""

    __slots__ = ("_keys", "generation")

    def __init__(self, keys: Mapping[str, Key], generation: str) -> None:
        self._keys = MappingProxyType(dict(keys))
        self.generation = generation

    def __getitem__(self, name: str) -> Key:
        return self._keys[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, name: str) -> Key:
        """The key called ``name``: 400 for an invalid name, 404 for an unknown one."""
        check_key_name(name)
        found = self._keys.get(name)
        if found is None:
            raise KeyNotFound(f"key {name!r} not found")
        return found
