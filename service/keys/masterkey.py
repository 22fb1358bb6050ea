"""Wrapping of key material at rest: AES-256-GCM under the master key.

Each blob is bound to its place in the keyring (key name, version, type) through the associated
data, so material cannot be moved from one key or version to another inside the file.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol

from service.crypto.aead import AesGcm
from service.crypto.base import InvalidCiphertext


class WrongMasterKey(Exception):
    """The keyring was written under another master key, or a blob was altered."""


class MasterKey:
    __slots__ = ("_aead", "_backup", "_mac_key", "_successor", "key_id")

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("master key must be 32 bytes")
        self._aead = AesGcm(key)
        # A public fingerprint so a wrong master key is reported clearly, not as 100 bad blobs.
        self.key_id = hmac.new(key, b"cryptd master key id", hashlib.sha256).hexdigest()[:16]
        self._mac_key = hmac.new(key, b"cryptd keyring mac", hashlib.sha256).digest()
        self._backup = AesGcm(hmac.new(key, b"cryptd key backup", hashlib.sha256).digest())
        self._successor = AesGcm(hmac.new(key, b"cryptd master key wrap", hashlib.sha256).digest())

    def mac(self, data: bytes) -> bytes:
        """Authenticates the keyring's metadata (versions, min_decryption_version, ...)."""
        return hmac.new(self._mac_key, data, hashlib.sha256).digest()

    def verify_mac(self, data: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.mac(data), tag)

    def seal_backup(self, payload: bytes, header: bytes) -> bytes:
        """Encrypt a key backup (service.keys.backup) under a key of its own, derived from the
        master key; ``header`` is authenticated with it."""
        return self._backup.seal(payload, header)

    def open_backup(self, body: bytes, header: bytes) -> bytes:
        """Inverse of seal_backup; InvalidCiphertext if the body or the header was altered or
        sealed under another master key."""
        return self._backup.open(body, header)

    def _between(self, other_id: str) -> bytes:
        return b"cryptd-master-key-wrap/1\x00%s\x00%s" % (self.key_id.encode(), other_id.encode())

    def wrap_master(self, key: bytes) -> bytes:
        """Another master key wrapped under this one (the Shamir seal's hand-over of a rotated
        key to processes still holding this one, or a retired key kept under its successor),
        bound to both keys' ids."""
        return self._successor.seal(key, self._between(MasterKey(key).key_id))

    def unwrap_master(self, blob: bytes, key_id: str) -> bytes | None:
        """Inverse of wrap_master for the key ``key_id``; None if the blob was altered or
        wrapped under another key."""
        try:
            key = self._successor.open(blob, self._between(key_id))
        except InvalidCiphertext:
            return None
        if len(key) != 32 or not hmac.compare_digest(MasterKey(key).key_id, key_id):
            return None
        return key

    @staticmethod
    def _context(name: str, version: int, type_name: str) -> bytes:
        return b"cryptd-keyring/1\x00%s\x00%d\x00%s" % (
            name.encode(),
            version,
            type_name.encode(),
        )

    def wrap(self, material: bytes, *, name: str, version: int, type_name: str) -> bytes:
        return self._aead.seal(material, self._context(name, version, type_name))

    def unwrap(self, blob: bytes, *, name: str, version: int, type_name: str) -> bytes:
        try:
            return self._aead.open(blob, self._context(name, version, type_name))
        except InvalidCiphertext:
            raise WrongMasterKey(f"key {name!r} version {version} does not unwrap") from None

    def __getstate__(self) -> None:
        raise TypeError("the master key cannot be pickled")

    def __repr__(self) -> str:
        return f"<MasterKey id={self.key_id}>"


class MasterKeySource(Protocol):
    """Where a process finds master keys other than the one it started with (the seal's,
    after a rotation by another process: service/seal/rotation.py)."""

    def find(self, key_id: str) -> MasterKey | None:
        """The current or staged master key with this id (a keyring may be written under it)."""
        ...

    def find_retired(self, key_id: str) -> MasterKey | None:
        """A master key a rotation retired: it opens backups made before, never a keyring."""
        ...
