"""The keyring file: JSON, every version's material wrapped under the master key.

Writes are atomic (temp file in the same directory, fsync, rename, fsync of the directory) and
serialised between processes by an advisory lock on a sibling ``.lock`` file.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from service.crypto.registry import KEY_TYPES
from service.fileio import atomic_write
from service.keys.keyring import Key, Keyring, KeyVersion, check_key_name, load_handle
from service.keys.masterkey import MasterKey

FILE_FORMAT = "cryptd-keyring/1"


class KeyringFileError(Exception):
    """The keyring file is unreadable, malformed or written under another master key."""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class VersionRecord:
    version: int
    created_at: str
    material: bytes  # wrapped

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "created_at": self.created_at,
            "material": base64.b64encode(self.material).decode(),
        }


@dataclass
class KeyRecord:
    type: str
    created_at: str
    min_decryption_version: int = 1
    deletion_allowed: bool = False
    versions: list[VersionRecord] = field(default_factory=list)
    derived: bool = False
    convergent: bool = False

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "type": self.type,
            "created_at": self.created_at,
            "min_decryption_version": self.min_decryption_version,
            "deletion_allowed": self.deletion_allowed,
            "versions": [v.to_json() for v in self.versions],
        }
        # Written only when set, so the MAC of a file without derived keys is unchanged.
        if self.derived:
            data["derived"] = True
        if self.convergent:
            data["convergent"] = True
        return data


@dataclass
class KeyringDocument:
    """The file's content, material still wrapped. Mutated only under the file lock."""

    master_key_id: str
    keys: dict[str, KeyRecord] = field(default_factory=dict)
    mac: bytes = b""

    def canonical(self) -> bytes:
        """What the document MAC covers: everything but the MAC, sorted, compact."""
        return orjson.dumps(
            {
                "format": FILE_FORMAT,
                "master_key_id": self.master_key_id,
                "keys": {name: rec.to_json() for name, rec in self.keys.items()},
            },
            option=orjson.OPT_SORT_KEYS,
        )

    def to_bytes(self, master: MasterKey) -> bytes:
        """Serialise, (re)computing the MAC over the current content."""
        self.mac = master.mac(self.canonical())
        return orjson.dumps(
            {
                "format": FILE_FORMAT,
                "master_key_id": self.master_key_id,
                "keys": {name: rec.to_json() for name, rec in sorted(self.keys.items())},
                "mac": base64.b64encode(self.mac).decode(),
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> KeyringDocument:
        try:
            raw = orjson.loads(data)
            if raw.get("format") != FILE_FORMAT:
                raise KeyringFileError(f"unsupported keyring format {raw.get('format')!r}")
            keys: dict[str, KeyRecord] = {}
            for name, rec in raw["keys"].items():
                check_key_name(name)
                versions = [
                    VersionRecord(
                        version=int(v["version"]),
                        created_at=str(v["created_at"]),
                        material=base64.b64decode(v["material"], validate=True),
                    )
                    for v in rec["versions"]
                ]
                if not versions or sorted(v.version for v in versions) != list(
                    range(1, len(versions) + 1)
                ):
                    raise KeyringFileError(f"key {name!r} has missing or duplicate versions")
                if rec["type"] not in KEY_TYPES:
                    raise KeyringFileError(f"key {name!r} has unknown type {rec['type']!r}")
                flags = {flag: rec.get(flag, False) for flag in ("derived", "convergent")}
                if not all(isinstance(value, bool) for value in flags.values()):
                    raise KeyringFileError(f"key {name!r} has a non-boolean flag")
                keys[name] = KeyRecord(
                    type=rec["type"],
                    created_at=str(rec["created_at"]),
                    min_decryption_version=int(rec["min_decryption_version"]),
                    deletion_allowed=bool(rec["deletion_allowed"]),
                    versions=versions,
                    **flags,
                )
            return cls(
                master_key_id=str(raw["master_key_id"]),
                keys=keys,
                mac=base64.b64decode(raw["mac"], validate=True),
            )
        except KeyringFileError:
            raise
        except Exception as exc:  # any structural problem; never echo file content
            raise KeyringFileError(f"malformed keyring file ({type(exc).__name__})") from None

    def verify(self, master: MasterKey) -> None:
        """Refuse a document written under another master key or whose MAC does not verify."""
        if self.master_key_id != master.key_id:
            raise KeyringFileError(
                f"keyring was written under master key {self.master_key_id}, "
                f"this process has {master.key_id}"
            )
        if not master.verify_mac(self.canonical(), self.mac):
            raise KeyringFileError("keyring integrity check failed (metadata altered)")

    def build(self, master: MasterKey, generation: str, activation_delay: float = 0.0) -> Keyring:
        """Unwrap and parse every version: the only place material is decrypted."""
        self.verify(master)
        keys: dict[str, Key] = {}
        for name, rec in self.keys.items():
            key_type = KEY_TYPES[rec.type]
            versions: dict[int, KeyVersion] = {}
            for v in rec.versions:
                material = master.unwrap(
                    v.material, name=name, version=v.version, type_name=rec.type
                )
                handle = load_handle(
                    key_type,
                    material,
                    name=name,
                    version=v.version,
                    derived=rec.derived,
                    convergent=rec.convergent,
                )
                versions[v.version] = KeyVersion(v.version, v.created_at, handle)
            keys[name] = Key(
                name=name,
                type=key_type,
                created_at=rec.created_at,
                min_decryption_version=rec.min_decryption_version,
                deletion_allowed=rec.deletion_allowed,
                versions=versions,
                activation_delay=activation_delay,
                derived=rec.derived,
                convergent=rec.convergent,
            )
        return Keyring(keys, generation)


def generation_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class KeyringFile:
    """Reads and atomically rewrites one keyring file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> tuple[KeyringDocument, str]:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise KeyringFileError(f"cannot read keyring {self.path}: {exc.strerror}") from None
        return KeyringDocument.from_bytes(data), generation_of(data)

    def load(self, master: MasterKey, activation_delay: float = 0.0) -> Keyring:
        document, generation = self.read()
        try:
            return document.build(master, generation, activation_delay)
        except KeyringFileError:
            raise
        except Exception as exc:
            raise KeyringFileError(f"keyring does not load: {exc}") from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive lock across processes for a read-modify-write."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(lock_path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def write(self, document: KeyringDocument, master: MasterKey) -> str:
        """Atomically replace the file; returns the new generation."""
        data = document.to_bytes(master)
        atomic_write(self.path, data)
        return generation_of(data)
