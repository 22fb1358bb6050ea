"""Changes to keys: create, rotate, update (versions, flags, state), delete, cancel a deletion.

Each checks its arguments, makes what takes time (new key material) before the store's lock,
and hands :meth:`service.keys.snapshot.Snapshot.apply` the edit of the document, which checks
against what is stored and either commits the whole change or nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TypedDict, Unpack

from service.crypto.registry import KEY_TYPES
from service.defaults import MAX_DELETION_WAITING_PERIOD
from service.errors import Conflict, InvalidRequest
from service.keys.document import KeyRecord, KeyringDocument, utc_now
from service.keys.keyring import (
    INTERNAL_PREFIX,
    PENDING_DELETION,
    SETTABLE_STATES,
    Key,
    check_key_flags,
    check_key_name,
    check_stored_name,
    format_time,
    is_internal,
)
from service.keys.records import (
    Destroyed,
    KeyWork,
    Material,
    add_version,
    claim_name,
    live_record,
    not_pending,
    wrap_version,
)

# Vault Transit's floor for automatic rotation; development servers accept any period.
MIN_AUTO_ROTATE_PERIOD = 3600
MAX_AUTO_ROTATE_PERIOD = 10 * 366 * 86400


class KeySettings(TypedDict, total=False):
    """What :meth:`KeyMutations.update` changes (None or absent: unchanged)."""

    min_decryption_version: int | None
    deletion_allowed: bool | None
    auto_rotate_period: int | None
    state: str | None
    min_encryption_version: int | None


@dataclass
class KeyMutations(KeyWork):
    """``deletion_waiting_period`` (seconds): 0 deletes at once; above, :meth:`delete` marks
    the key for the schedule (service.keys.schedule) to destroy once the date has passed."""

    min_auto_rotate_period: int = MIN_AUTO_ROTATE_PERIOD
    deletion_waiting_period: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.deletion_waiting_period <= MAX_DELETION_WAITING_PERIOD:
            raise ValueError("the deletion waiting period is out of range")

    def _check_period(self, period: int | None) -> None:
        if period is None or period == 0:
            return
        if not self.min_auto_rotate_period <= period <= MAX_AUTO_ROTATE_PERIOD:
            raise InvalidRequest(
                f"auto_rotate_period must be 0 (off) or between {self.min_auto_rotate_period} "
                f"and {MAX_AUTO_ROTATE_PERIOD} seconds"
            )

    def create(
        self,
        name: str,
        type_name: str,
        *,
        deletion_allowed: bool = False,
        material: bytes | None = None,
        auto_rotate_period: int = 0,
        derived: bool = False,
        convergent: bool = False,
    ) -> Key:
        """Create a key; ``material`` (already validated by the type's import) imports one."""
        check_key_name(name)
        if type_name not in KEY_TYPES:
            raise InvalidRequest(f"unknown key type {type_name!r}")
        check_key_flags(KEY_TYPES[type_name], derived=derived, convergent=convergent)
        self._check_period(auto_rotate_period)
        # Generated before the store's lock is taken: an RSA-4096 key takes seconds.
        fresh = material if material is not None else KEY_TYPES[type_name].generate()

        destroyed: Destroyed = []

        def change(document: KeyringDocument) -> None:
            claim_name(document, name, destroyed)
            document.keys[name] = KeyRecord(
                type=type_name,
                created_at=utc_now(),
                versions=[wrap_version(self.master, name, type_name, 1, fresh)],
                deletion_allowed=deletion_allowed,
                auto_rotate_period=auto_rotate_period,
                derived=derived,
                convergent=convergent,
            )

        created = self.snapshot.apply(change)[0][name]
        self.tell_destroyed(destroyed)
        return created

    def rotate(self, name: str, *, material: bytes | None = None) -> Key:
        check_key_name(name)
        known = self.snapshot.keyring.get(name)
        fresh: Material | None = None
        if material is not None:
            fresh = (known.type.name if known is not None else "", material)
        elif known is not None:
            fresh = (known.type.name, known.type.generate())

        def change(document: KeyringDocument) -> None:
            add_version(self.master, document, name, fresh, imported=material is not None)

        return self.snapshot.apply(change)[0][name]

    def update(self, name: str, **settings: Unpack[KeySettings]) -> Key:
        """Change a key's settings; the result is checked as a whole (Vault Transit's rules:
        ``min_encryption_version`` is 0 or between ``min_decryption_version`` and the latest
        version). A key pending deletion changes nothing until its deletion is cancelled."""
        return self.update_with_previous(name, **settings)[0]

    def update_with_previous(
        self,
        name: str,
        *,
        min_decryption_version: int | None = None,
        deletion_allowed: bool | None = None,
        auto_rotate_period: int | None = None,
        state: str | None = None,
        min_encryption_version: int | None = None,
    ) -> tuple[Key, str]:
        """:meth:`update`, and the state the key had before (for the audit log)."""
        check_key_name(name)
        changes = (
            min_decryption_version,
            deletion_allowed,
            auto_rotate_period,
            state,
            min_encryption_version,
        )
        if all(value is None for value in changes):
            raise InvalidRequest(
                "nothing to change: send min_decryption_version, deletion_allowed, "
                "auto_rotate_period, state or min_encryption_version"
            )
        self._check_period(auto_rotate_period)
        if state is not None and state not in SETTABLE_STATES:
            hint = " (DELETE schedules a deletion)" if state == PENDING_DELETION else ""
            raise InvalidRequest(f"state must be one of {', '.join(SETTABLE_STATES)}{hint}")
        if min_encryption_version is not None and min_encryption_version < 0:
            raise InvalidRequest("min_encryption_version must be 0 (none) or a key version")
        previous: list[str] = []

        def change(document: KeyringDocument) -> None:
            record = live_record(document, name)
            previous.append(record.state)
            not_pending(name, record, "update")
            latest = record.latest_version
            if min_decryption_version is not None:
                if not 1 <= min_decryption_version <= latest:
                    raise InvalidRequest(f"min_decryption_version must be between 1 and {latest}")
                record.min_decryption_version = min_decryption_version
            if min_encryption_version is not None:
                if min_encryption_version > latest:
                    raise InvalidRequest(
                        f"min_encryption_version must be 0 (none) or at most {latest}, the "
                        "latest version"
                    )
                record.min_encryption_version = min_encryption_version
            floor = record.min_encryption_version
            if floor and floor < record.min_decryption_version:
                raise InvalidRequest(
                    f"min_encryption_version ({floor}) must be 0 or at least "
                    f"min_decryption_version ({record.min_decryption_version})"
                )
            if deletion_allowed is not None:
                record.deletion_allowed = deletion_allowed
            if auto_rotate_period is not None:
                record.auto_rotate_period = auto_rotate_period
            if state is not None:
                record.state = state

        key = self.snapshot.apply(change)[0][name]
        return key, previous[-1]

    def delete(self, name: str) -> Key | None:
        """Delete a key that allows it: at once without a waiting period (None), else mark
        it ``pending_deletion`` until the waiting period has passed and return it (the state
        it had is kept for :meth:`cancel_deletion`)."""
        check_key_name(name)
        period = self.deletion_waiting_period

        def change(document: KeyringDocument) -> None:
            record = live_record(document, name)
            not_pending(name, record, "delete")
            if not record.deletion_allowed:
                raise Conflict(f"key {name!r} does not allow deletion")
            if period <= 0:
                del document.keys[name]
                return
            # Rounded up to the second the document stores: never a moment early.
            record.deletion_date = format_time(math.ceil(time.time()) + period)
            record.state_before_deletion = record.state
            record.state = PENDING_DELETION

        keyring, _ = self.snapshot.apply(change)
        return None if period <= 0 else keyring[name]

    def cancel_deletion(self, name: str) -> Key:
        """Undo a scheduled deletion before its date: the key returns to the state it had
        (409 conflict when none is scheduled; 404 once the date has passed)."""
        check_key_name(name)

        def change(document: KeyringDocument) -> None:
            record = live_record(document, name)
            if record.state != PENDING_DELETION or record.state_before_deletion is None:
                raise Conflict(f"key {name!r} is not scheduled for deletion")
            record.state = record.state_before_deletion
            record.state_before_deletion = None
            record.deletion_date = None

        return self.snapshot.apply(change)[0][name]

    def ensure_internal_key(self, name: str, type_name: str) -> Key:
        """The internal key ``name`` (``cryptd:...``), created in one store transaction if no
        replica made it yet: replicas racing end with one key."""
        if not is_internal(name):
            raise ValueError("internal key names start with " + INTERNAL_PREFIX)
        check_stored_name(name)
        found = self.snapshot.keyring.internal.get(name)
        if found is not None:
            return found
        fresh = KEY_TYPES[type_name].generate()

        def change(document: KeyringDocument) -> None:
            if name not in document.keys:
                document.keys[name] = KeyRecord(
                    type=type_name,
                    created_at=utc_now(),
                    versions=[wrap_version(self.master, name, type_name, 1, fresh)],
                )

        return self.snapshot.apply(change)[0].internal[name]
