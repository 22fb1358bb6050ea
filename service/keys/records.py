"""What the kinds of change share: edits of the keyring document, and :class:`KeyWork`.

Each runs inside a change transaction (:meth:`service.keys.snapshot.Snapshot.apply`) on the
document read under the store's lock, so what it checks (a key's existence, its deletion
date, its latest version) is what is committed: nothing done meanwhile by another replica is
undone or done twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.crypto.registry import KEY_TYPES
from service.errors import Conflict, KeyNotFound
from service.keys.document import KeyRecord, KeyringDocument, VersionRecord, utc_now
from service.keys.keyring import PENDING_DELETION, check_state, parse_time
from service.keys.masterkey import MasterKey
from service.keys.snapshot import Snapshot

log = logging.getLogger("cryptd.keyring")

Material = tuple[str, bytes]  # (type name it was made for, material)
# (name, deletion date) of keys whose material a committed change destroyed
Destroyed = list[tuple[str, str]]


def wrap_version(
    master: MasterKey,
    name: str,
    type_name: str,
    version: int,
    material: bytes,
    created_at: str | None = None,
) -> VersionRecord:
    wrapped = master.wrap(material, name=name, version=version, type_name=type_name)
    return VersionRecord(version, created_at or utc_now(), wrapped)


def past_date(record: KeyRecord, now: float) -> bool:
    return record.deletion_date is not None and now >= parse_time(record.deletion_date)


def drop_if_past(document: KeyringDocument, name: str, now: float, destroyed: Destroyed) -> bool:
    """Remove ``name`` from the document if its deletion date has passed."""
    record = document.keys.get(name)
    if record is None or record.deletion_date is None or not past_date(record, now):
        return False
    del document.keys[name]
    destroyed.append((name, record.deletion_date))
    return True


def claim_name(document: KeyringDocument, name: str, destroyed: Destroyed) -> None:
    """Make room for a new key called ``name``: refused (409) while a key holds it, pending
    deletion included; a key past its deletion date is destroyed in the same transaction."""
    drop_if_past(document, name, time.time(), destroyed)
    record = document.keys.get(name)
    if record is None:
        return
    if record.state == PENDING_DELETION:
        raise Conflict(
            f"key {name!r} already exists (pending deletion until {record.deletion_date})"
        )
    raise Conflict(f"key {name!r} already exists")


def live_record(document: KeyringDocument, name: str) -> KeyRecord:
    """The record called ``name``; 404 also for one past its deletion date."""
    record = document.keys.get(name)
    if record is None or past_date(record, time.time()):
        raise KeyNotFound(f"key {name!r} not found")
    return record


def not_pending(name: str, record: KeyRecord, use: str) -> None:
    if record.state == PENDING_DELETION:
        check_state(name, record.state, use, record.deletion_date)


def add_version(
    master: MasterKey,
    document: KeyringDocument,
    name: str,
    fresh: Material | None,
    *,
    imported: bool = False,
) -> int:
    """Add the next version, numbered from the document read inside the transaction: two
    replicas rotating at once get two distinct versions, one after the other. Material made
    before the lock for another type (the key was deleted and created again meanwhile) is
    not used; imported material for another type is refused."""
    record = live_record(document, name)
    not_pending(name, record, "rotate")
    material = fresh[1] if fresh is not None and fresh[0] == record.type else None
    if imported and material is None:
        raise Conflict(f"key {name!r} is not of the type the imported material was made for")
    if material is None:
        material = KEY_TYPES[record.type].generate()
    version = record.latest_version + 1
    record.versions.append(wrap_version(master, name, record.type, version, material))
    return version


@dataclass
class KeyWork:
    """What every kind of change works with: the snapshot it commits through, the master key
    that wraps material, and whom to tell of destroyed keys (``on_destroy(name,
    deletion_date)``, for the audit log)."""

    snapshot: Snapshot
    on_destroy: Callable[[str, str], None] | None = None

    @property
    def master(self) -> MasterKey:
        """The master key the snapshot serves under (a master-key rotation changes it)."""
        return self.snapshot.master

    def tell_destroyed(self, destroyed: Destroyed) -> None:
        """Tell of keys destroyed by a committed change (log and ``on_destroy``)."""
        for name, date in destroyed:
            log.info("key material destroyed", extra={"key": name, "deletion_date": date})
            if self.on_destroy is not None:
                self.on_destroy(name, date)
