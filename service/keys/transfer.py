"""Keys in and out of the keyring whole: export and import, sealed backup and restore.

Export unwraps every version for a caller that wraps it again before it leaves the process
(an encrypted backup: :mod:`service.keys.backup`); import wraps the material under this
master key and inserts the key in one change transaction.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from service.crypto.registry import KEY_TYPES
from service.errors import InvalidRequest, KeyNotFound
from service.keys import backup
from service.keys.document import KeyRecord, KeyringDocument, MalformedDocument
from service.keys.keyring import Key, check_key_name, check_stored_name, load_handle
from service.keys.masterkey import MasterKey
from service.keys.records import (
    Destroyed,
    KeyWork,
    claim_name,
    not_pending,
    past_date,
    wrap_version,
)


@dataclass(frozen=True)
class KeyExport:
    """A key with its material in the clear, as :meth:`KeyTransfer.export_key` gives it:
    ``metadata`` as the key record stores it (without versions), ``versions`` as
    (number, created_at, material). Never printed, never pickled."""

    name: str
    metadata: Mapping[str, Any]
    versions: tuple[tuple[int, str, bytes], ...] = field(repr=False)

    def __getstate__(self) -> NoReturn:
        raise TypeError("exported key material cannot be pickled")


@dataclass
class KeyTransfer(KeyWork):
    """Export, import, backup and restore of whole keys."""

    def export_key(self, name: str) -> KeyExport:
        """One key's metadata and every version's material in the clear (for an encrypted
        backup; the caller wraps it before it leaves the process)."""
        check_stored_name(name)
        self.snapshot.current()  # never export what a change acknowledged on this host took away
        document = self.snapshot.document
        record = None if document is None else document.keys.get(name)
        if record is None or past_date(record, time.time()):
            raise KeyNotFound(f"key {name!r} not found")
        not_pending(name, record, "backup")
        versions = tuple(
            (
                v.version,
                v.created_at,
                self.master.unwrap(v.material, name=name, version=v.version, type_name=record.type),
            )
            for v in record.versions
        )
        metadata = {k: v for k, v in record.to_json().items() if k != "versions"}
        return KeyExport(name, metadata, versions)

    def backup(self, name: str) -> bytes:
        """One key, every version and its metadata, sealed under the master key
        (service.keys.backup; docs/FORMAT.md section 10)."""
        export = self.export_key(check_key_name(name))
        return backup.seal(self.master, export.name, export.metadata, export.versions)

    def restore(self, name: str, blob: bytes) -> Key:
        """Restore a backup of ``name`` made by any cryptd holding this master key (400 for a
        blob that is not one, or of another key; 409 if the name is taken)."""
        check_key_name(name)
        key_id = backup.key_id_of(blob)
        master = self.snapshot.backup_key(key_id) if key_id is not None else None
        stored, metadata, versions = backup.open_(master or self.master, blob)
        if stored != name:
            raise InvalidRequest(f"the backup holds key {stored!r}, not {name!r}")
        return self.import_key(KeyExport(stored, metadata, versions))

    def import_key(self, export: KeyExport, name: str | None = None) -> Key:
        """Insert a whole key (metadata and every version) in one transaction, under
        ``name`` (default: the exported name); refused (409) if the name is taken."""
        target = check_key_name(name or export.name)
        type_name = export.metadata.get("type")
        if not isinstance(type_name, str) or type_name not in KEY_TYPES:
            raise InvalidRequest("the key's type is missing or unknown")

        def record_under(master: MasterKey) -> KeyRecord:
            versions = [
                wrap_version(master, target, type_name, number, material).to_json()
                | {"created_at": created_at}
                for number, created_at, material in export.versions
            ]
            try:
                return KeyRecord.from_json({**export.metadata, "versions": versions}, "key")
            except MalformedDocument as exc:
                raise InvalidRequest(f"the key record is invalid ({exc})") from None

        wrapped_with = self.master
        record = record_under(wrapped_with)  # checked before the store's lock is taken
        _check_loads(target, record, export.versions)
        destroyed: Destroyed = []

        def change(document: KeyringDocument) -> None:
            claim_name(document, target, destroyed)
            # A master-key rotation may have happened meanwhile: wrap under the key the store
            # is under now (apply adopted it before calling this).
            master = self.master
            document.keys[target] = record if master is wrapped_with else record_under(master)

        imported = self.snapshot.apply(change)[0][target]
        self.tell_destroyed(destroyed)
        return imported


def _check_loads(
    name: str, record: KeyRecord, versions: tuple[tuple[int, str, bytes], ...]
) -> None:
    """Load every version as the keyring will once it is stored (400 otherwise): material that
    does not load would make the stored keyring fail verification on every worker, which is
    not for a request to cause."""
    key_type = KEY_TYPES[record.type]
    for number, _, material in versions:
        try:
            load_handle(
                key_type,
                material,
                name=name,
                version=number,
                derived=record.derived,
                convergent=record.convergent,
            )
        except Exception:  # whatever the parser raises: the message names no material
            raise InvalidRequest(
                f"version {number} of the key's material does not load as {record.type}"
            ) from None
