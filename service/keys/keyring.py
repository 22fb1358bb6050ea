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
from typing import Final

from service.crypto import derived as derivation
from service.crypto.base import KeyHandle, KeyType
from service.errors import InvalidRequest, KeyDisabled, KeyNotFound

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")
# The token's associated data holds the version as a u32 (docs/FORMAT.md): no key version can
# be larger, and a request naming one is refused as malformed (400), never looked up (404).
MAX_KEY_VERSION = 2**32 - 1


# Key states (docs/FORMAT.md section 6): what each lets a key do. ``decrypt_only`` keeps the
# key's existing data readable (decrypt, verify, rewrap *from* it) and refuses anything that
# makes new data under it; ``disabled`` refuses everything and is undone by PATCH;
# ``pending_deletion`` is set by DELETE with a waiting period and undone by cancel-deletion.
ENABLED = "enabled"
DECRYPT_ONLY = "decrypt_only"
DISABLED = "disabled"
PENDING_DELETION = "pending_deletion"
STATES = (ENABLED, DECRYPT_ONLY, DISABLED, PENDING_DELETION)
SETTABLE_STATES = (ENABLED, DECRYPT_ONLY, DISABLED)  # through PATCH
# Uses a decrypt_only key allows: reading what exists. "rewrap" is rewrap *from* the key.
READING_USES = frozenset({"decrypt", "verify", "rewrap", "decapsulate"})


def check_state(name: str, state: str, use: str, deletion_date: str | None = None) -> None:
    """Refuse (409 key_disabled) ``use`` of a key in ``state``; the message names both."""
    if state == ENABLED or (state == DECRYPT_ONLY and use in READING_USES):
        return
    message = f"key {name!r} is {state}: {use} is refused"
    if state == PENDING_DELETION:
        message += f" (deletion scheduled for {deletion_date}; cancel-deletion restores it)"
    raise KeyDisabled(message)


def parse_time(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 UTC time as keyrings store it (``...Z``)."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def format_time(seconds: float) -> str:
    """The RFC 3339 UTC text (whole seconds, ``Z``) keyrings store for a time."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# Keys the service keeps for itself (an import wrapping key): stored and authenticated like any
# other, under names no client can give (':' is outside the user pattern), never listed and
# never reachable by a route that takes a key name.
INTERNAL_PREFIX = "cryptd:"


def is_internal(name: str) -> bool:
    return name.startswith(INTERNAL_PREFIX)


def check_stored_name(name: str) -> str:
    """A name a stored keyring may hold: a user key name, or an internal one."""
    check_key_name(name[len(INTERNAL_PREFIX) :] if is_internal(name) else name)
    return name


def check_key_name(name: str) -> str:
    if name in _VALID_NAMES:  # checked before: one set lookup instead of a regex match
        return name
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidRequest("key name must match [A-Za-z0-9_.-]{1,128} and not be '.' or '..'")
    if len(_VALID_NAMES) < _VALID_NAMES_MAX:
        _VALID_NAMES.add(name)
    return name


# Names check_key_name has accepted (every crypto request checks its key's name twice), a
# bounded number: names a client makes up beyond it are checked each time.
_VALID_NAMES: set[str] = set()
_VALID_NAMES_MAX: Final = 4096


# Names a new key may not take: GET /v1/keys/wrapping-key is the import wrapping key, so a user
# key of that name could never be described. (One made before the route existed keeps working.)
RESERVED_NAMES = frozenset({"wrapping-key"})


def check_new_key_name(name: str) -> str:
    """A name a key may be created, imported or restored under (400 otherwise)."""
    check_key_name(name)
    if name in RESERVED_NAMES:
        raise InvalidRequest(
            f"the key name {name!r} is reserved (GET /v1/keys/{name} is the import wrapping key)"
        )
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
    # The blob as stored (wrapped under the master key, not secret): a reload that finds the
    # same blob at the same place keeps this parsed handle instead of unwrapping again.
    wrapped: bytes = field(default=b"", repr=False, compare=False)

    @property
    def created_ts(self) -> float:
        return parse_time(self.created_at)


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
    auto_rotate_period: int = 0
    state: str = ENABLED
    min_encryption_version: int = 0  # 0: no floor (Vault's meaning)
    deletion_date: str | None = None  # while pending_deletion: when the material goes

    def check_use(self, use: str) -> None:
        """Refuse (409) ``use`` (an operation, or "rewrap to") the key's state does not allow."""
        if self.state != ENABLED:
            check_state(self.name, self.state, use, self.deletion_date)

    def destroyed(self, now: float) -> bool:
        """Past its deletion date: gone, whether or not the material is destroyed yet."""
        return self.deletion_date is not None and now >= parse_time(self.deletion_date)

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

    def version(self, requested: int | None = None, *, encrypting: bool = False) -> KeyVersion:
        """The version to use: the latest by default. Refuses versions below 1 or below
        ``min_decryption_version`` (400) and versions that do not exist (404). ``encrypting``
        (encrypt, sign, hmac, datakey, rewrap's target) also refuses versions below
        ``min_encryption_version`` (400), as Vault Transit does."""
        if requested is None:
            requested = max(self.active_version(), self.min_decryption_version)
            if encrypting:
                requested = max(requested, self.min_encryption_version)
        if requested < 1 or requested > MAX_KEY_VERSION:
            raise InvalidRequest(f"key_version must be from 1 to {MAX_KEY_VERSION}")
        if requested < self.min_decryption_version:
            raise InvalidRequest(
                f"key version {requested} is below min_decryption_version "
                f"{self.min_decryption_version}"
            )
        if encrypting and requested < self.min_encryption_version:
            raise InvalidRequest(
                f"key version {requested} is below min_encryption_version "
                f"{self.min_encryption_version}"
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
            "auto_rotate_period": self.auto_rotate_period,
            "state": self.state,
            "min_encryption_version": self.min_encryption_version,
            **({} if self.deletion_date is None else {"deletion_date": self.deletion_date}),
        }

    def rotation_due(self, now: float) -> bool:
        """Automatic rotation: the newest version is older than ``auto_rotate_period``. Only
        enabled keys rotate: a retired key gets no new material."""
        if self.auto_rotate_period <= 0 or self.state != ENABLED:
            return False
        return now >= self.versions[self.latest_version].created_ts + self.auto_rotate_period

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
    """Immutable snapshot of every key. ``generation`` rises by one with every change of the
    stored keyring; ``digest`` identifies the content; ``deployment_id`` the key store it came
    from (None for a keyring file written before deployment ids existed)."""

    __slots__ = ("_keys", "deployment_id", "digest", "generation", "internal")

    def __init__(
        self,
        keys: Mapping[str, Key],
        *,
        generation: int,
        digest: str,
        deployment_id: str | None = None,
    ) -> None:
        self._keys = MappingProxyType({n: k for n, k in keys.items() if not is_internal(n)})
        self.internal = MappingProxyType({n: k for n, k in keys.items() if is_internal(n)})
        self.generation = generation
        self.digest = digest
        self.deployment_id = deployment_id

    def __getitem__(self, name: str) -> Key:
        return self._keys[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, name: str) -> Key:
        """The key called ``name``: 400 for an invalid name, 404 for an unknown one, or one
        past its deletion date (never served, even before its material is destroyed)."""
        check_key_name(name)
        found = self._keys.get(name)
        if found is None or (found.deletion_date is not None and found.destroyed(time.time())):
            raise KeyNotFound(f"key {name!r} not found")
        return found

    def live(self, now: float | None = None) -> list[Key]:
        """Every key not past its deletion date, by name."""
        moment = time.time() if now is None else now
        return [self._keys[n] for n in sorted(self._keys) if not self._keys[n].destroyed(moment)]
