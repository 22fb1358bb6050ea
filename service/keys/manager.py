"""Owns the current keyring snapshot: loading, refreshing from the store, key management.

Readers take ``manager.keyring`` (an immutable snapshot) and never lock. A change runs as one
store transaction: read the stored document under the store's lock, verify it fully (a store
that fails verification is never written: its MAC would launder the damage), apply the change
one generation up, build and check the new keyring, and only then commit; the new snapshot is
served by this process the moment the commit returns. Any failure leaves the store and the
snapshot as they were. A refresh that fails keeps the previous snapshot and records why.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from service.crypto.registry import KEY_TYPES
from service.errors import Conflict, InvalidRequest, KeyNotFound, KeystoreUnavailable
from service.keys import backup
from service.keys.board import Board
from service.keys.document import (
    KeyRecord,
    KeyringDocument,
    MalformedDocument,
    VersionRecord,
    utc_now,
)
from service.keys.filestore import FileKeyStore
from service.keys.integrity import (
    Verified,
    build_keyring,
    check_succession,
    next_document,
    open_document,
    seal,
)
from service.keys.keyring import (
    ENABLED,
    INTERNAL_PREFIX,
    PENDING_DELETION,
    SETTABLE_STATES,
    Key,
    Keyring,
    check_key_flags,
    check_key_name,
    check_state,
    check_stored_name,
    format_time,
    is_internal,
    parse_time,
)
from service.keys.masterkey import MasterKey
from service.keys.store import (
    IntegrityError,
    KeyStore,
    KeystoreError,
    NotInitialised,
    StoreUnavailable,
)

log = logging.getLogger("cryptd.keyring")
R = TypeVar("R")
_UNSET = object()

# Vault Transit's floor for automatic rotation; development servers accept any period.
MIN_AUTO_ROTATE_PERIOD = 3600
MAX_AUTO_ROTATE_PERIOD = 10 * 366 * 86400
# How long DELETE may wait before the material is destroyed (AWS KMS: 7 to 30 days).
MAX_DELETION_WAITING_PERIOD = 366 * 86400
# The periodic check compares a stamp (a stat, the header row); this often it reads and
# verifies the whole store anyway, so rows changed behind the service's back show in /readyz.
FULL_CHECK_INTERVAL = 60.0


@dataclass(frozen=True)
class KeyExport:
    """A key with its material in the clear, as :meth:`KeyManager.export_key` gives it:
    ``metadata`` as the key record stores it (without versions), ``versions`` as
    (number, created_at, material). Never printed, never pickled."""

    name: str
    metadata: Mapping[str, Any]
    versions: tuple[tuple[int, str, bytes], ...] = field(repr=False)

    def __getstate__(self) -> NoReturn:
        raise TypeError("exported key material cannot be pickled")


class KeyManager:
    def __init__(
        self,
        store: KeyStore | Path,
        master: MasterKey,
        *,
        read_only: bool = False,
        activation_delay: float = 0.0,
        on_reload: Callable[[bool], None] | None = None,
        expected_deployment: str | None = None,
        min_auto_rotate_period: int = MIN_AUTO_ROTATE_PERIOD,
        deletion_waiting_period: int = 0,
        on_destroy: Callable[[str, str], None] | None = None,
        board: Board | None = None,
    ) -> None:
        """``deletion_waiting_period`` (seconds): 0 deletes at once; above, :meth:`delete`
        schedules the deletion that :meth:`run_due` carries out once the date has passed.
        ``on_destroy(name, deletion_date)`` is told of every key whose material this process
        destroyed (for the audit log). ``board``: the generation board this host's workers
        share (service/keys/board.py); raised with every snapshot this process verifies or
        commits, so a change is in force on every sibling before it is answered."""
        self.store: KeyStore = FileKeyStore(store) if isinstance(store, Path) else store
        self.board = board if board is not None else Board()
        self._master = master
        self._read_only = read_only
        self._activation_delay = activation_delay
        self._on_reload = on_reload
        self._expected_deployment = expected_deployment
        self._min_auto_rotate_period = min_auto_rotate_period
        if not 0 <= deletion_waiting_period <= MAX_DELETION_WAITING_PERIOD:
            raise ValueError("the deletion waiting period is out of range")
        self.deletion_waiting_period = deletion_waiting_period
        self._on_destroy = on_destroy
        self._lock = threading.Lock()  # one change or refresh at a time in this process
        self._stamp: object = _UNSET
        self._verified_at = float("-inf")  # monotonic time of the last full read
        self._keyring: Keyring | None = None
        self._document: KeyringDocument | None = None  # what the snapshot was built from
        self.last_reload_error: str | None = None  # why the store's content was refused
        self.store_unreachable: str | None = None  # why the store could not be read

    @property
    def keyring(self) -> Keyring:
        if self._keyring is None:
            raise RuntimeError("keyring not loaded")
        return self._keyring

    @property
    def store_error(self) -> str | None:
        return self.store_unreachable or self.last_reload_error

    # Loading ------------------------------------------------------------------------------

    def load(self) -> Keyring:
        """Initial load; raises KeystoreError so that startup fails loudly."""
        with self._lock:
            stamp = self.store.stamp()
            raw = self.store.read()
            if raw is None:
                raise NotInitialised(
                    f"no keyring in {self.store.description} (create one with "
                    "`cryptd keystore init`)"
                )
            verified = open_document(raw, self._master)
            check_succession(None, verified, self._expected_deployment)
            self._keyring = build_keyring(verified, self._master, None, self._activation_delay)
            self._document = verified.document
            self._stamp = stamp
            self._verified_at = time.monotonic()
            self.board.raise_to(self._keyring.generation)
            log.info(
                "keyring loaded",
                extra={
                    "generation": self._keyring.generation,
                    "keys": len(self._keyring),
                    "pid": os.getpid(),
                    "store": self.store.backend,
                },
            )
            return self._keyring

    def refresh(self, *, force: bool = False) -> bool:
        """Load the stored keyring if it changed (always with ``force``), keeping the previous
        snapshot when the store is unreachable or its content is refused. Never raises.
        Returns True when a new snapshot is served."""
        with self._lock:
            try:
                stamp = self.store.stamp()
                due = time.monotonic() - self._verified_at > FULL_CHECK_INTERVAL
                if not force and not due and stamp == self._stamp:
                    self.store_unreachable = None
                    return False
                raw = self.store.read()
                self._verified_at = time.monotonic()
                self.store_unreachable = None
                if raw is None:
                    raise IntegrityError(f"the keyring in {self.store.description} is gone")
                verified = open_document(raw, self._master)
                if self._keyring is not None and verified.digest == self._keyring.digest:
                    self._stamp = stamp
                    self._reload_outcome(None)
                    return False
                check_succession(self._keyring, verified, self._expected_deployment)
                keyring = build_keyring(
                    verified, self._master, self._keyring, self._activation_delay
                )
            except StoreUnavailable as exc:
                if self.store_unreachable != str(exc):
                    log.error(
                        "key store unreachable; serving the keyring in memory",
                        extra={"reason": str(exc)},
                    )
                self.store_unreachable = str(exc)
                return False
            except Exception as exc:
                reason = str(exc) if isinstance(exc, KeystoreError) else type(exc).__name__
                self._reload_outcome(reason)
                return False
            self._keyring = keyring
            self._document = verified.document
            self._stamp = stamp
            self.board.raise_to(keyring.generation)
            self._reload_outcome(None)
            log.info(
                "keyring loaded",
                extra={"generation": keyring.generation, "keys": len(keyring), "pid": os.getpid()},
            )
            return True

    def caught_up(self) -> Keyring:
        """The snapshot in memory if it is as new as this host's board; else 503: a change
        acknowledged on this host is not loaded here yet (the store could not be read, or
        gave back an older keyring), and serving the older snapshot would undo it."""
        keyring = self.keyring
        enforced = self.board.generation
        if enforced > keyring.generation:
            why = self.store_error or f"the store holds generation {keyring.generation}"
            raise KeystoreUnavailable(
                f"a key change (keyring generation {enforced}) is in force on this host and "
                f"this worker could not load it yet ({why}); nothing was served. Retry in a "
                "moment; if this lasts, the key store lost acknowledged changes: check it, "
                "then restart cryptd"
            )
        return keyring

    def current(self) -> Keyring:
        """:meth:`caught_up`, reading the store first when the board is ahead (blocking: for
        threads; the event loop goes through service.keys.watch)."""
        if self.board.cell[0] > self.keyring.generation:
            self.refresh(force=True)
        return self.caught_up()

    def reload(self) -> bool:
        """Read the store now (SIGHUP). True when the stored keyring is the one served."""
        self.refresh(force=True)
        return self.store_error is None

    def reload_if_changed(self) -> bool:
        return self.refresh()

    def _reload_outcome(self, error: str | None) -> None:
        changed = error != self.last_reload_error
        self.last_reload_error = error
        if error is not None and changed:
            log.error("keyring refused; keeping the previous keyring", extra={"reason": error})
        if self._on_reload is not None and (changed or error is None):
            self._on_reload(error is None)

    # Key management -----------------------------------------------------------------------

    def _mutate(self, change: Callable[[KeyringDocument], R]) -> tuple[Keyring, R]:
        """One change in one store transaction (see the module docstring)."""
        if self._read_only:
            raise Conflict("the keyring is read-only on this instance; manage keys with the CLI")
        with self._lock:
            try:
                with self.store.transaction() as transaction:
                    raw = transaction.read()
                    if raw is None:
                        raise IntegrityError(f"the keyring in {self.store.description} is gone")
                    current = open_document(raw, self._master)
                    check_succession(self._keyring, current, self._expected_deployment)
                    document = next_document(current)
                    result = change(document)
                    if document.keys == current.document.keys:
                        # Nothing to change (a key already there, a rotation already done
                        # elsewhere): no write, no new generation; serve what is stored.
                        keyring = build_keyring(
                            current, self._master, self._keyring, self._activation_delay
                        )
                        document = current.document
                    else:
                        sealed, digest = seal(document, self._master)
                        keyring = build_keyring(
                            Verified(document, digest),
                            self._master,
                            self._keyring,
                            self._activation_delay,
                        )
                        transaction.write(sealed)
            except IntegrityError as exc:
                self._reload_outcome(str(exc))
                raise _refused(str(exc)) from None
            except StoreUnavailable as exc:
                raise _unavailable(str(exc)) from None
            self._keyring = keyring
            self._document = document
            # Before the caller answers: from here on no worker of this host serves an older
            # snapshot (each compares the board before it uses a key).
            self.board.raise_to(keyring.generation)
            self.last_reload_error = None
            self.store_unreachable = None
            try:
                self._stamp = self.store.stamp()
            except KeystoreError:
                self._stamp = _UNSET  # the next check reads the store again
            log.info(
                "keyring changed",
                extra={"generation": keyring.generation, "keys": len(keyring), "pid": os.getpid()},
            )
            return keyring, result

    def _wrap(
        self,
        name: str,
        type_name: str,
        version: int,
        material: bytes,
        created_at: str | None = None,
    ) -> VersionRecord:
        wrapped = self._master.wrap(material, name=name, version=version, type_name=type_name)
        return VersionRecord(version, created_at or utc_now(), wrapped)

    def _check_period(self, period: int | None) -> None:
        if period is None or period == 0:
            return
        if not self._min_auto_rotate_period <= period <= MAX_AUTO_ROTATE_PERIOD:
            raise InvalidRequest(
                f"auto_rotate_period must be 0 (off) or between {self._min_auto_rotate_period} "
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

        destroyed: list[tuple[str, str]] = []

        def change(document: KeyringDocument) -> None:
            _claim_name(document, name, destroyed)
            document.keys[name] = KeyRecord(
                type=type_name,
                created_at=utc_now(),
                versions=[self._wrap(name, type_name, 1, fresh)],
                deletion_allowed=deletion_allowed,
                auto_rotate_period=auto_rotate_period,
                derived=derived,
                convergent=convergent,
            )

        created = self._mutate(change)[0][name]
        self._destroyed(destroyed)
        return created

    def rotate(self, name: str, *, material: bytes | None = None) -> Key:
        check_key_name(name)
        known = self.keyring.get(name)
        fresh: Material | None = None
        if material is not None:
            fresh = (known.type.name if known is not None else "", material)
        elif known is not None:
            fresh = (known.type.name, known.type.generate())

        def change(document: KeyringDocument) -> None:
            _rotate(self, document, name, fresh, imported=material is not None)

        return self._mutate(change)[0][name]

    def update(
        self,
        name: str,
        *,
        min_decryption_version: int | None = None,
        deletion_allowed: bool | None = None,
        auto_rotate_period: int | None = None,
        state: str | None = None,
        min_encryption_version: int | None = None,
    ) -> Key:
        """Change a key's settings; the result is checked as a whole (Vault Transit's rules:
        ``min_encryption_version`` is 0 or between ``min_decryption_version`` and the latest
        version). A key pending deletion changes nothing until its deletion is cancelled."""
        return self.update_with_previous(
            name,
            min_decryption_version=min_decryption_version,
            deletion_allowed=deletion_allowed,
            auto_rotate_period=auto_rotate_period,
            state=state,
            min_encryption_version=min_encryption_version,
        )[0]

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
            record = _live_record(document, name)
            previous.append(record.state)
            _not_pending(name, record, "update")
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

        key = self._mutate(change)[0][name]
        return key, previous[-1]

    def delete(self, name: str) -> Key | None:
        """Delete a key that allows it: at once without a waiting period (None), else mark
        it ``pending_deletion`` until the waiting period has passed and return it (the state
        it had is kept for :meth:`cancel_deletion`)."""
        check_key_name(name)
        period = self.deletion_waiting_period

        def change(document: KeyringDocument) -> None:
            record = _live_record(document, name)
            _not_pending(name, record, "delete")
            if not record.deletion_allowed:
                raise Conflict(f"key {name!r} does not allow deletion")
            if period <= 0:
                del document.keys[name]
                return
            # Rounded up to the second the document stores: never a moment early.
            record.deletion_date = format_time(math.ceil(time.time()) + period)
            record.state_before_deletion = record.state
            record.state = PENDING_DELETION

        keyring, _ = self._mutate(change)
        return None if period <= 0 else keyring[name]

    def cancel_deletion(self, name: str) -> Key:
        """Undo a scheduled deletion before its date: the key returns to the state it had
        (409 conflict when none is scheduled; 404 once the date has passed)."""
        check_key_name(name)

        def change(document: KeyringDocument) -> None:
            record = _live_record(document, name)
            if record.state != PENDING_DELETION or record.state_before_deletion is None:
                raise Conflict(f"key {name!r} is not scheduled for deletion")
            record.state = record.state_before_deletion
            record.state_before_deletion = None
            record.deletion_date = None

        return self._mutate(change)[0][name]

    def ensure_internal_key(self, name: str, type_name: str) -> Key:
        """The internal key ``name`` (``cryptd:...``), created in one store transaction if no
        replica made it yet: replicas racing end with one key."""
        if not is_internal(name):
            raise ValueError("internal key names start with " + INTERNAL_PREFIX)
        check_stored_name(name)
        found = self.keyring.internal.get(name)
        if found is not None:
            return found
        fresh = KEY_TYPES[type_name].generate()

        def change(document: KeyringDocument) -> None:
            if name not in document.keys:
                document.keys[name] = KeyRecord(
                    type=type_name,
                    created_at=utc_now(),
                    versions=[self._wrap(name, type_name, 1, fresh)],
                )

        return self._mutate(change)[0].internal[name]

    def export_key(self, name: str) -> KeyExport:
        """One key's metadata and every version's material in the clear (for an encrypted
        backup; the caller wraps it before it leaves the process)."""
        check_stored_name(name)
        self.current()  # never export what a change acknowledged on this host took away
        record = None if self._document is None else self._document.keys.get(name)
        if record is None or _past_date(record, time.time()):
            raise KeyNotFound(f"key {name!r} not found")
        _not_pending(name, record, "backup")
        versions = tuple(
            (
                v.version,
                v.created_at,
                self._master.unwrap(
                    v.material, name=name, version=v.version, type_name=record.type
                ),
            )
            for v in record.versions
        )
        metadata = {k: v for k, v in record.to_json().items() if k != "versions"}
        return KeyExport(name, metadata, versions)

    def backup(self, name: str) -> bytes:
        """One key, every version and its metadata, sealed under the master key
        (service.keys.backup; docs/FORMAT.md section 10)."""
        export = self.export_key(check_key_name(name))
        return backup.seal(self._master, export.name, export.metadata, export.versions)

    def restore(self, name: str, blob: bytes) -> Key:
        """Restore a backup of ``name`` made by any cryptd holding this master key (400 for a
        blob that is not one, or of another key; 409 if the name is taken)."""
        check_key_name(name)
        stored, metadata, versions = backup.open_(self._master, blob)
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
        versions = [
            self._wrap(target, type_name, number, material).to_json() | {"created_at": created_at}
            for number, created_at, material in export.versions
        ]
        try:
            record = KeyRecord.from_json({**export.metadata, "versions": versions}, "key")
        except MalformedDocument as exc:
            raise InvalidRequest(f"the key record is invalid ({exc})") from None

        destroyed: list[tuple[str, str]] = []

        def change(document: KeyringDocument) -> None:
            _claim_name(document, target, destroyed)
            document.keys[target] = record

        imported = self._mutate(change)[0][target]
        self._destroyed(destroyed)
        return imported

    # Scheduled work: automatic rotation, destruction after the waiting period -------------

    def due_for_rotation(self, now: float | None = None) -> list[str]:
        """Keys whose automatic rotation is due in the snapshot served now."""
        moment = time.time() if now is None else now
        return sorted(name for name, key in self.keyring.items() if key.rotation_due(moment))

    def due_for_destruction(self, now: float | None = None) -> list[str]:
        """Keys past their deletion date in the snapshot served now."""
        moment = time.time() if now is None else now
        return sorted(name for name, key in self.keyring.items() if key.destroyed(moment))

    def has_due_work(self) -> bool:
        """Cheap (a look at the snapshot): is a rotation or a destruction due?"""
        now = time.time()
        return any(k.rotation_due(now) or k.destroyed(now) for k in self.keyring.values())

    def rotate_due(self) -> list[tuple[str, int]]:
        """Rotate every key that is due (see :meth:`run_due`)."""
        return self.run_due()[0]

    def run_due(self, *, rotate: bool = True) -> tuple[list[tuple[str, int]], list[str]]:
        """Rotate every key that is due (unless ``rotate`` is false) and destroy every key
        past its deletion date, if this process wins the store's scheduling lock (one process
        of all replicas does): the rotated (name, version) and the destroyed names. Dueness
        is checked again on the document read inside each transaction, so nothing done
        meanwhile elsewhere is done twice."""
        if self._read_only or not self.has_due_work():
            return [], []
        rotated: list[tuple[str, int]] = []
        destroyed: list[tuple[str, str]] = []
        # The lock keeps its name from before destruction was scheduled here: a replica of
        # the previous release and one of this release never rotate at the same time.
        with self.store.try_lock("rotate") as held:
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
                pass  # _mutate logged why; the next round tries again
        self._destroyed(destroyed)
        return rotated, [name for name, _ in destroyed]

    def _rotate_if_due(self, name: str) -> int | None:
        key_type = self.keyring[name].type
        fresh = (key_type.name, key_type.generate())

        def change(document: KeyringDocument) -> int | None:
            record = document.keys.get(name)
            if record is None or not _due(record, time.time()):
                return None
            return _rotate(self, document, name, fresh)

        _, version = self._mutate(change)
        if version is not None:
            log.info("key rotated automatically", extra={"key": name, "key_version": version})
        return version

    def _destroy_due(self, destroyed: list[tuple[str, str]]) -> None:
        """Remove, in one transaction, every key whose deletion date has passed in the
        document read inside it (a deletion cancelled meanwhile is kept)."""

        def change(document: KeyringDocument) -> None:
            now = time.time()
            for name in sorted(document.keys):
                _drop_if_past(document, name, now, destroyed)

        self._mutate(change)

    def _destroyed(self, destroyed: list[tuple[str, str]]) -> None:
        """Tell of keys destroyed by a committed change (log and ``on_destroy``)."""
        for name, date in destroyed:
            log.info("key material destroyed", extra={"key": name, "deletion_date": date})
            if self._on_destroy is not None:
                self._on_destroy(name, date)


def _past_date(record: KeyRecord, now: float) -> bool:
    return record.deletion_date is not None and now >= parse_time(record.deletion_date)


def _drop_if_past(
    document: KeyringDocument, name: str, now: float, destroyed: list[tuple[str, str]]
) -> bool:
    """Remove ``name`` from the document if its deletion date has passed."""
    record = document.keys.get(name)
    if record is None or record.deletion_date is None or not _past_date(record, now):
        return False
    del document.keys[name]
    destroyed.append((name, record.deletion_date))
    return True


def _claim_name(document: KeyringDocument, name: str, destroyed: list[tuple[str, str]]) -> None:
    """Make room for a new key called ``name``: refused (409) while a key holds it, pending
    deletion included; a key past its deletion date is destroyed in the same transaction."""
    _drop_if_past(document, name, time.time(), destroyed)
    record = document.keys.get(name)
    if record is None:
        return
    if record.state == PENDING_DELETION:
        raise Conflict(
            f"key {name!r} already exists (pending deletion until {record.deletion_date})"
        )
    raise Conflict(f"key {name!r} already exists")


def _live_record(document: KeyringDocument, name: str) -> KeyRecord:
    """The record called ``name``; 404 also for one past its deletion date."""
    record = _record(document, name)
    if _past_date(record, time.time()):
        raise KeyNotFound(f"key {name!r} not found")
    return record


def _not_pending(name: str, record: KeyRecord, use: str) -> None:
    if record.state == PENDING_DELETION:
        check_state(name, record.state, use, record.deletion_date)


def _due(record: KeyRecord, now: float) -> bool:
    if record.auto_rotate_period <= 0 or record.state != ENABLED:
        return False
    latest = max(record.versions, key=lambda v: v.version)
    return now >= parse_time(latest.created_at) + record.auto_rotate_period


Material = tuple[str, bytes]  # (type name it was made for, material)


def _rotate(
    manager: KeyManager,
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
    record = _live_record(document, name)
    _not_pending(name, record, "rotate")
    material = fresh[1] if fresh is not None and fresh[0] == record.type else None
    if imported and material is None:
        raise Conflict(f"key {name!r} is not of the type the imported material was made for")
    if material is None:
        material = KEY_TYPES[record.type].generate()
    version = record.latest_version + 1
    record.versions.append(manager._wrap(name, record.type, version, material))
    return version


def _refused(reason: str) -> KeystoreUnavailable:
    log.error("key management refused: the key store failed verification", extra={"reason": reason})
    return KeystoreUnavailable(
        f"the key store failed verification ({reason}); key management is refused and "
        "nothing was changed. Crypto keeps serving the keyring loaded before. Restore the "
        "keyring from a backup (or undo the edit), then retry."
    )


def _unavailable(reason: str) -> KeystoreUnavailable:
    log.error("key management refused: the key store is unavailable", extra={"reason": reason})
    return KeystoreUnavailable(
        f"{reason}; nothing was changed and the keyring in memory still serves. Retry once "
        "the store is back (free space, fix permissions, or restore the database connection)."
    )


def _record(document: KeyringDocument, name: str) -> KeyRecord:
    record = document.keys.get(name)
    if record is None:
        raise KeyNotFound(f"key {name!r} not found")
    return record


def create_keyring_file(path: Path, master: MasterKey) -> None:
    """Write an empty keyring (refuses to overwrite an existing file)."""
    from service.keys.admin import initialise

    initialise(FileKeyStore(path), master)
