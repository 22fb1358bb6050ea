"""The keyring document: every key's metadata and wrapped versions, as a key store keeps it.

A store holds the document as JSON-compatible data (:data:`RawDocument`: the keyring file's
JSON, or the rows of a database put back together); this module parses it into records and
renders records back. It does no I/O and no cryptography: the MAC and the unwrapping live in
:mod:`service.keys.integrity`, above every store.

Adding a field to a key is one line in :class:`KeyRecord` (with its default, which is what a
document written before the field existed means) and, if it needs one, a rule in
:meth:`KeyRecord.check`.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import types
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Union, get_args, get_origin, get_type_hints

import orjson

from service.crypto.registry import KEY_TYPES
from service.errors import InvalidRequest
from service.keys.approvals import Approval
from service.keys.keyring import (
    ENABLED,
    PENDING_DELETION,
    SETTABLE_STATES,
    STATES,
    check_key_flags,
    check_stored_name,
)

FORMAT_V1 = "cryptd-keyring/1"  # no deployment id and no generation; read, never written
FORMAT = "cryptd-keyring/2"
FORMATS = (FORMAT_V1, FORMAT)

RawDocument = dict[str, Any]


class MalformedDocument(ValueError):
    """The stored data is not a keyring document (the message names the place, never data)."""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class VersionRecord:
    version: int
    created_at: str
    material: bytes  # wrapped under the master key

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "created_at": self.created_at,
            "material": base64.b64encode(self.material).decode(),
        }

    @classmethod
    def from_json(cls, raw: Any, where: str) -> VersionRecord:
        if not isinstance(raw, dict) or set(raw) != {"version", "created_at", "material"}:
            raise MalformedDocument(f"{where}: a version needs version, created_at, material")
        version = raw["version"]
        if type(version) is not int or version < 1:
            raise MalformedDocument(f"{where}: version must be a positive integer")
        created_at = _timestamp(raw["created_at"], f"{where} created_at")
        try:
            material = base64.b64decode(raw["material"], validate=True)
        except (TypeError, ValueError):
            raise MalformedDocument(f"{where}: material is not base64") from None
        if not material:
            raise MalformedDocument(f"{where}: material is empty")
        return cls(version, created_at, material)


@dataclass
class KeyRecord:
    """One key's metadata and versions. Every field but ``versions`` is metadata: rendered
    under its own name, parsed with a type check from its annotation, authenticated by the
    document MAC like everything else."""

    type: str
    created_at: str
    versions: list[VersionRecord] = field(default_factory=list)
    min_decryption_version: int = 1
    deletion_allowed: bool = False
    auto_rotate_period: int = 0  # seconds; 0: no automatic rotation
    # Set at creation, never changed; written only when true (section 8 of docs/FORMAT.md).
    derived: bool = field(default=False, metadata={"omit_default": True})
    convergent: bool = field(default=False, metadata={"omit_default": True})
    # Written only when not the default, so a keyring that uses none of them stays readable
    # by a cryptd from before they existed, and one that does is refused by it (an unknown
    # field) instead of being served without its restriction.
    state: str = field(default=ENABLED, metadata={"omit_default": True})
    min_encryption_version: int = field(default=0, metadata={"omit_default": True})
    # While pending_deletion: when the material is destroyed, and the state to go back to.
    deletion_date: str | None = field(default=None, metadata={"omit_default": True})
    state_before_deletion: str | None = field(default=None, metadata={"omit_default": True})

    @property
    def latest_version(self) -> int:
        return max(v.version for v in self.versions)

    def check(self, where: str) -> None:
        """Rules across fields; raise MalformedDocument."""
        if self.type not in KEY_TYPES:
            raise MalformedDocument(f"{where}: unknown key type {self.type!r}")
        numbers = sorted(v.version for v in self.versions)
        if not numbers or numbers != list(range(1, len(numbers) + 1)):
            raise MalformedDocument(f"{where}: versions must be 1..N without gaps or repeats")
        if not 1 <= self.min_decryption_version <= numbers[-1]:
            raise MalformedDocument(f"{where}: min_decryption_version out of range")
        if self.auto_rotate_period < 0:
            raise MalformedDocument(f"{where}: auto_rotate_period is negative")
        if self.state not in STATES:
            raise MalformedDocument(f"{where}: unknown state {self.state[:40]!r}")
        if self.min_encryption_version != 0 and not (
            self.min_decryption_version <= self.min_encryption_version <= numbers[-1]
        ):
            raise MalformedDocument(f"{where}: min_encryption_version out of range")
        pending = self.state == PENDING_DELETION
        if pending != (self.deletion_date is not None) or pending != (
            self.state_before_deletion is not None
        ):
            raise MalformedDocument(
                f"{where}: deletion_date and state_before_deletion go with pending_deletion"
            )
        if self.deletion_date is not None:
            _timestamp(self.deletion_date, f"{where} deletion_date")
        if self.state_before_deletion is not None and (
            self.state_before_deletion not in SETTABLE_STATES
        ):
            raise MalformedDocument(f"{where}: state_before_deletion is not a state to restore")
        try:
            check_key_flags(KEY_TYPES[self.type], derived=self.derived, convergent=self.convergent)
        except InvalidRequest as exc:
            raise MalformedDocument(f"{where}: {exc.message}") from None
        _timestamp(self.created_at, f"{where} created_at")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "versions" or (f.metadata.get("omit_default") and value == f.default):
                continue
            out[f.name] = value
        out["versions"] = [v.to_json() for v in sorted(self.versions, key=lambda v: v.version)]
        return out

    @classmethod
    def from_json(cls, raw: Any, where: str) -> KeyRecord:
        if not isinstance(raw, dict):
            raise MalformedDocument(f"{where}: a key must be an object")
        fields = _metadata_fields()
        unknown = set(raw) - set(fields) - {"versions"}
        if unknown:
            # A newer cryptd wrote a field this one does not know: serving the key while
            # ignoring it (a state, a limit) could do what that field forbids.
            raise MalformedDocument(f"{where}: unknown field {sorted(unknown)[0]!r}")
        values: dict[str, Any] = {}
        for name, (kind, required) in fields.items():
            if name == "versions":
                continue
            if name not in raw:
                if required:
                    raise MalformedDocument(f"{where}: missing {name}")
                continue
            values[name] = _typed(raw[name], kind, f"{where} {name}")
        versions = raw.get("versions")
        if not isinstance(versions, list):
            raise MalformedDocument(f"{where}: versions must be a list")
        values["versions"] = [
            VersionRecord.from_json(v, f"{where} version #{i + 1}") for i, v in enumerate(versions)
        ]
        record = cls(**values)
        record.check(where)
        return record


@dataclass
class KeyringDocument:
    """The whole keyring with its material wrapped; no MAC (that is the integrity layer's)."""

    master_key_id: str
    deployment_id: str | None = None
    generation: int = 0
    keys: dict[str, KeyRecord] = field(default_factory=dict)
    format: str = FORMAT
    # Dual control (service/keys/approvals.py): written only when there are some, so a
    # keyring that never used them stays readable by a cryptd from before them.
    approvals: dict[str, Approval] = field(default_factory=dict)

    def copy(self) -> KeyringDocument:
        return copy.deepcopy(self)

    def render(self) -> RawDocument:
        """The document as stored, without its MAC."""
        keys = {name: self.keys[name].to_json() for name in sorted(self.keys)}
        if self.format == FORMAT_V1:
            return {"format": FORMAT_V1, "master_key_id": self.master_key_id, "keys": keys}
        rendered: RawDocument = {
            "format": FORMAT,
            "deployment_id": self.deployment_id,
            "generation": self.generation,
            "master_key_id": self.master_key_id,
            "keys": keys,
        }
        if self.approvals:
            rendered["approvals"] = {a: self.approvals[a].to_json() for a in sorted(self.approvals)}
        return rendered

    @classmethod
    def parse(
        cls, raw: RawDocument, reuse: tuple[RawDocument, KeyringDocument] | None = None
    ) -> KeyringDocument:
        """Structure and types only; the caller has verified the MAC first. ``reuse``: a raw
        document parsed before and what it parsed to; a key whose raw entry is the very same
        object there (a store's :meth:`read_keys` shares what it did not read again) keeps
        its record instead of being parsed again (~0.1 ms a key: most of a refresh)."""
        if not isinstance(raw, dict):
            raise MalformedDocument("the keyring is not an object")
        fmt = raw.get("format")
        if fmt not in FORMATS:
            raise MalformedDocument(f"unsupported keyring format {str(fmt)[:40]!r}")
        expected = {"format", "master_key_id", "keys", "mac"}
        if fmt == FORMAT:
            expected |= {"deployment_id", "generation", "approvals"}
        if set(raw) - expected:
            raise MalformedDocument(f"unknown field {sorted(set(raw) - expected)[0]!r}")
        master_key_id = raw.get("master_key_id")
        if not isinstance(master_key_id, str):
            raise MalformedDocument("master_key_id must be a string")
        deployment_id: str | None = None
        generation = 0
        if fmt == FORMAT:
            deployment_id = raw.get("deployment_id")
            stored = raw.get("generation")
            if not isinstance(deployment_id, str) or not deployment_id:
                raise MalformedDocument("deployment_id must be a string")
            if type(stored) is not int or stored < 1:
                raise MalformedDocument("generation must be a positive integer")
            generation = stored
        keys_raw = raw.get("keys")
        if not isinstance(keys_raw, dict):
            raise MalformedDocument("keys must be an object")
        keys: dict[str, KeyRecord] = {}
        before_raw, before = reuse if reuse is not None else ({}, None)
        before_keys = before_raw.get("keys", {})
        for name, record in keys_raw.items():
            if before is not None and record is before_keys.get(name) and name in before.keys:
                keys[name] = before.keys[name]
                continue
            try:
                check_stored_name(name)
            except Exception:
                raise MalformedDocument("a key has an invalid name") from None
            keys[name] = KeyRecord.from_json(record, f"key {name!r}")
        approvals_raw = raw.get("approvals", {})
        if not isinstance(approvals_raw, dict):
            raise MalformedDocument("approvals must be an object")
        approvals: dict[str, Approval] = {}
        for approval_id, record in approvals_raw.items():
            if len(approval_id) != 32 or approval_id.strip("0123456789abcdef"):
                raise MalformedDocument("an approval has an invalid id")
            try:
                approvals[approval_id] = Approval.from_json(record, "an approval")
            except ValueError as exc:
                raise MalformedDocument(str(exc)) from None
        return cls(master_key_id, deployment_id, generation, keys, fmt, approvals)


def canonical(raw: RawDocument) -> bytes:
    """What the document MAC covers: the stored document without ``mac``, keys sorted at every
    level, no whitespace. Computed over what is stored, so fields a record fills in by default
    are covered exactly as they were written."""
    content = {name: value for name, value in raw.items() if name != "mac"}
    try:
        return orjson.dumps(content, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        raise MalformedDocument("the keyring holds values JSON cannot represent") from None


_FIELDS: dict[str, tuple[Any, bool]] | None = None


def _metadata_fields() -> dict[str, tuple[Any, bool]]:
    """KeyRecord's fields: name -> (annotation, required)."""
    global _FIELDS
    if _FIELDS is None:
        hints = get_type_hints(KeyRecord)
        _FIELDS = {
            f.name: (
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(KeyRecord)
        }
    return _FIELDS


def _typed(value: Any, kind: Any, where: str) -> Any:
    """``value`` if it has the annotated type (``int``, ``bool``, ``str``, ``X | None``);
    bool is not taken for int."""
    if get_origin(kind) in (Union, types.UnionType):
        options = get_args(kind)
        if value is None and type(None) in options:
            return None
        kinds = [k for k in options if k is not type(None)]
        if len(kinds) == 1:
            return _typed(value, kinds[0], where)
        raise MalformedDocument(f"{where}: unsupported field type")
    if kind in (int, bool, str) and type(value) is kind:
        return value
    raise MalformedDocument(f"{where} must be of type {getattr(kind, '__name__', kind)}")


def _timestamp(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise MalformedDocument(f"{where} must be a string")
    try:
        datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        raise MalformedDocument(f"{where} is not an RFC 3339 UTC time") from None
    return value
