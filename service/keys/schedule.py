"""Work that falls due with time: automatic rotation, destruction after the waiting period.

The server's scheduler calls :meth:`KeySchedule.run_due` (``cryptd keys destroy-due`` too);
one process of all replicas wins the store's scheduling lock and does the round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from service.errors import KeystoreUnavailable
from service.keys.document import KeyRecord, KeyringDocument
from service.keys.keyring import ENABLED, parse_time
from service.keys.records import Destroyed, KeyWork, add_version, drop_if_past

log = logging.getLogger("cryptd.keyring")


@dataclass
class KeySchedule(KeyWork):
    """Automatic rotation and destruction after the waiting period, when due."""

    def due_for_rotation(self, now: float | None = None) -> list[str]:
        """Keys whose automatic rotation is due in the snapshot served now."""
        moment = time.time() if now is None else now
        return sorted(
            name for name, key in self.snapshot.keyring.items() if key.rotation_due(moment)
        )

    def due_for_destruction(self, now: float | None = None) -> list[str]:
        """Keys past their deletion date in the snapshot served now."""
        moment = time.time() if now is None else now
        return sorted(name for name, key in self.snapshot.keyring.items() if key.destroyed(moment))

    def has_due_work(self) -> bool:
        """Cheap (a look at the snapshot): is a rotation or a destruction due?"""
        now = time.time()
        return any(k.rotation_due(now) or k.destroyed(now) for k in self.snapshot.keyring.values())

    def rotate_due(self) -> list[tuple[str, int]]:
        """Rotate every key that is due (see :meth:`run_due`)."""
        return self.run_due()[0]

    def run_due(self, *, rotate: bool = True) -> tuple[list[tuple[str, int]], list[str]]:
        """Rotate every key that is due (unless ``rotate`` is false) and destroy every key
        past its deletion date, if this process wins the store's scheduling lock (one process
        of all replicas does): the rotated (name, version) and the destroyed names. Dueness
        is checked again on the document read inside each transaction, so nothing done
        meanwhile elsewhere is done twice."""
        if self.snapshot.read_only or not self.has_due_work():
            return [], []
        rotated: list[tuple[str, int]] = []
        destroyed: Destroyed = []
        # The lock keeps its name from before destruction was scheduled here: a replica of
        # the previous release and one of this release never rotate at the same time.
        with self.snapshot.store.try_lock("rotate") as held:
            if not held:
                return [], []
            try:
                for name in self.due_for_rotation() if rotate else ():
                    version = self._rotate_if_due(name)
                    if version is not None:
                        rotated.append((name, version))
                if self.due_for_destruction():
                    self._destroy_due(destroyed)
            except KeystoreUnavailable:
                pass  # Snapshot.apply logged why; the next round tries again
        self.tell_destroyed(destroyed)
        return rotated, [name for name, _ in destroyed]

    def _rotate_if_due(self, name: str) -> int | None:
        key_type = self.snapshot.keyring[name].type
        fresh = (key_type.name, key_type.generate())

        def change(document: KeyringDocument) -> int | None:
            record = document.keys.get(name)
            if record is None or not _due(record, time.time()):
                return None
            return add_version(self.master, document, name, fresh)

        _, version = self.snapshot.apply(change)
        if version is not None:
            log.info("key rotated automatically", extra={"key": name, "key_version": version})
        return version

    def _destroy_due(self, destroyed: Destroyed) -> None:
        """Remove, in one transaction, every key whose deletion date has passed in the
        document read inside it (a deletion cancelled meanwhile is kept)."""

        def change(document: KeyringDocument) -> None:
            now = time.time()
            for name in sorted(document.keys):
                drop_if_past(document, name, now, destroyed)

        self.snapshot.apply(change)


def _due(record: KeyRecord, now: float) -> bool:
    if record.auto_rotate_period <= 0 or record.state != ENABLED:
        return False
    latest = max(record.versions, key=lambda v: v.version)
    return now >= parse_time(latest.created_at) + record.auto_rotate_period
