"""The keyring this process serves, kept in step with the key store.

Readers take ``snapshot.keyring`` (immutable) and never lock. The snapshot changes in two
ways, one at a time in this process: a refresh reads the store and serves what it holds once
verified (a refresh that fails keeps the previous snapshot and records why); :meth:`apply`
runs one change as one store transaction: read the stored document under the store's lock,
verify it fully (a store that fails verification is never written: its MAC would launder the
damage), apply the change one generation up, build and check the new keyring, and only then
commit; the new snapshot is served the moment the commit returns. Any failure leaves the
store and the snapshot as they were. What a change is lives elsewhere
(:mod:`service.keys.mutations`, :mod:`service.keys.transfer`, :mod:`service.keys.schedule`).

A refresh after notifications that named the keys each change wrote (:meth:`Snapshot.heard`,
every generation since the snapshot's) reads only those keys' rows and the header
(:meth:`~service.keys.store.KeyStore.read_keys`), puts them into the document it served, and
verifies the MAC over that whole document; it parses and builds only those keys. A document
that does not verify (a notification missed, rows changed by someone else) is never served:
the refresh reads and verifies everything instead, as it always did; so does every forced
refresh and the periodic full check.

Over 400 lines as one module: loading, refreshing and committing share one lock and one set
of fields (the served keyring, its document, its stamp); split, each half would reach into
the other's state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from service.errors import Conflict, KeystoreUnavailable
from service.keys.board import Board
from service.keys.document import KeyringDocument, RawDocument
from service.keys.integrity import (
    Verified,
    build_keyring,
    check_succession,
    next_document,
    open_document,
    rewrap,
    seal,
)
from service.keys.keyring import Keyring
from service.keys.masterkey import MasterKey, MasterKeySource
from service.keys.store import (
    Changed,
    CommitUnconfirmed,
    IntegrityError,
    KeyStore,
    KeystoreError,
    NotInitialised,
    StoreUnavailable,
)

log = logging.getLogger("cryptd.keyring")
R = TypeVar("R")
_UNSET = object()

# The periodic check compares a stamp (a stat, the header row); this often it reads and
# verifies the whole store anyway, so rows changed behind the service's back show in /readyz.
FULL_CHECK_INTERVAL = 60.0
# Generations heard of and not yet loaded, kept at most (a store unreadable for long): the
# oldest go first, and a refresh missing one reads everything.
HEARD_LIMIT = 1024


class Snapshot:
    def __init__(
        self,
        store: KeyStore,
        master: MasterKey,
        board: Board,
        *,
        read_only: bool = False,
        activation_delay: float = 0.0,
        on_reload: Callable[[bool], None] | None = None,
        expected_deployment: str | None = None,
        lookup: MasterKeySource | None = None,
    ) -> None:
        self.store = store
        self._lookup = lookup
        self.board = board
        self._master = master
        self._read_only = read_only
        self._activation_delay = activation_delay
        self._on_reload = on_reload
        self._expected_deployment = expected_deployment
        self._lock = threading.Lock()  # one change or refresh at a time in this process
        self._stamp: object = _UNSET
        self._verified_at = float("-inf")  # monotonic time of the last full read
        self._keyring: Keyring | None = None
        self.document: KeyringDocument | None = None  # what the snapshot was built from
        self._raw: RawDocument | None = None  # ``document`` as stored (MAC included)
        # generation -> the keys its change wrote (None: not said), from notifications; the
        # event loop adds, a refresh (in a thread) takes: a lock of its own, never held long.
        self._heard: dict[int, frozenset[str] | None] = {}
        self._heard_lock = threading.Lock()
        self.last_reload_error: str | None = None  # why the store's content was refused
        self.store_unreachable: str | None = None  # why the store could not be read

    @property
    def master(self) -> MasterKey:
        """The master key the store is written under, as far as this process knows."""
        return self._master

    def backup_key(self, key_id: str) -> MasterKey | None:
        """The master key a backup names: this one, or one retired by a rotation (kept so
        backups made before it still restore)."""
        if key_id == self._master.key_id:
            return self._master
        if self._lookup is None:
            return None
        return self._lookup.find(key_id) or self._lookup.find_retired(key_id)

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def keyring(self) -> Keyring:
        if self._keyring is None:
            raise RuntimeError("keyring not loaded")
        return self._keyring

    @property
    def store_error(self) -> str | None:
        return self.store_unreachable or self.last_reload_error

    # Reading the store --------------------------------------------------------------------

    def _open(
        self, raw: RawDocument, reuse: tuple[RawDocument, KeyringDocument] | None = None
    ) -> tuple[Verified, MasterKey]:
        """Verify ``raw`` under the master key it names: this process's, or (after a rotation
        elsewhere) the one ``lookup`` finds. Never changes what this process uses."""
        claimed = raw.get("master_key_id")
        if isinstance(claimed, str) and claimed != self._master.key_id and self._lookup:
            found = self._lookup.find(claimed)
            if found is not None and found.key_id == claimed:
                return open_document(raw, found), found
            raise IntegrityError(
                f"the keyring is written under master key {claimed[:16]!r}, which this process "
                f"cannot find (it holds {self._master.key_id}): a master-key rotation whose new "
                "key has not reached this host, or another deployment's keyring"
            )
        return open_document(raw, self._master, reuse), self._master

    def _adopt_master(self, master: MasterKey) -> None:
        if master is not self._master:
            log.info(
                "master key changed",
                extra={"master_key_id": master.key_id, "pid": os.getpid()},
            )
            self._master = master

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
            verified, master = self._open(raw)
            check_succession(None, verified, self._expected_deployment)
            self._keyring = build_keyring(verified, master, None, self._activation_delay)
            self._adopt_master(master)
            self.document, self._raw = verified.document, raw
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

    def heard(self, notice: Changed) -> None:
        """A notification: the change to ``notice.generation`` wrote ``notice.keys`` (called
        on the event loop before the refresh it starts; cheap, never blocks on a refresh)."""
        if notice.generation is None:
            return
        with self._heard_lock:
            self._heard[notice.generation] = notice.keys
            while len(self._heard) > HEARD_LIMIT:
                del self._heard[min(self._heard)]

    def _named_since(self, generation: int) -> tuple[frozenset[str], int] | None:
        """The keys the changes after ``generation`` wrote, and the newest generation heard
        of; None when none was heard of (a store without notifications, a check not started
        by one), or a generation in between was not, or was not named.

        The notice of ``generation`` itself, when it is the newest heard of, gives no names:
        the header alone is read, once (this worker committed that change, and its own
        notification's check came after the commit; the store is verified to hold what it
        serves without reading every row again, which under load cost the committing worker
        hundreds of milliseconds of CPU just as its answer left)."""
        with self._heard_lock:
            for old in [g for g in self._heard if g < generation]:
                del self._heard[old]
            if not self._heard:
                return None
            newest = max(self._heard)
            if newest == generation:
                del self._heard[generation]  # used once: a later check reads as before
                return frozenset(), generation
            names: set[str] = set()
            for g in range(generation + 1, newest + 1):
                named = self._heard.get(g)
                if named is None:
                    return None
                names |= named
        return frozenset(names), newest

    def _read_changed(self) -> tuple[Verified, MasterKey, RawDocument] | None:
        """The stored document read through the keys notifications named, verified whole;
        None when that cannot be done or does not verify (the caller reads everything)."""
        if self._raw is None or self._keyring is None or self.document is None:
            return None
        named = self._named_since(self._keyring.generation)
        if named is None:
            return None
        names, newest = named
        raw = self.store.read_keys(self._raw, names)
        if raw is None or not isinstance(raw.get("generation"), int) or raw["generation"] > newest:
            return None  # a change not heard of yet: its keys are unknown
        try:
            verified, master = self._open(raw, reuse=(self._raw, self.document))
            check_succession(self._keyring, verified, self._expected_deployment)
        except IntegrityError as exc:
            # Not served; the full read below decides, and says why if it refuses too.
            log.info("partial keyring read refused; reading it whole", extra={"reason": str(exc)})
            return None
        return verified, master, raw

    def refresh(self, *, force: bool = False) -> bool:
        """Load the stored keyring if it changed (always with ``force``), keeping the previous
        snapshot when the store is unreachable or its content is refused. Never raises.
        Returns True when a new snapshot is served. Reads only the keys notifications named
        when it can (see the module docstring); never when forced or the full check is due."""
        with self._lock:
            try:
                stamp = self.store.stamp()
                due = time.monotonic() - self._verified_at > FULL_CHECK_INTERVAL
                if not force and not due and stamp == self._stamp:
                    self.store_unreachable = None
                    return False
                partial = None if force or due else self._read_changed()
                if partial is not None:
                    verified, master, raw = partial
                    self.store_unreachable = None
                else:
                    raw_read = self.store.read()
                    self._verified_at = time.monotonic()
                    self.store_unreachable = None
                    if raw_read is None:
                        raise IntegrityError(f"the keyring in {self.store.description} is gone")
                    raw = raw_read
                    verified, master = self._open(raw)
                if self._keyring is not None and verified.digest == self._keyring.digest:
                    self._stamp = stamp
                    self._reload_outcome(None)
                    return False
                check_succession(self._keyring, verified, self._expected_deployment)
                keyring = build_keyring(
                    verified,
                    master,
                    self._keyring,
                    self._activation_delay,
                    previous_master=None if master is self._master else self._master,
                    previous_records=None if self.document is None else self.document.keys,
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
            self.document, self._raw = verified.document, raw
            self._stamp = stamp
            self._adopt_master(master)
            self.board.raise_to(keyring.generation)
            self._reload_outcome(None)
            log.info(
                "keyring loaded",
                extra={
                    "generation": keyring.generation,
                    "keys": len(keyring),
                    "pid": os.getpid(),
                    "read": "whole" if partial is None else "named keys",
                },
            )
            return True

    def caught_up(self, enforced: int | None = None) -> Keyring:
        """The snapshot in memory if it is as new as this host's board; else 503: a change
        acknowledged on this host is not loaded here yet (the store could not be read, or
        gave back an older keyring), and serving the older snapshot would undo it.

        ``enforced``: the board as the request found it when it arrived. A change committed
        on this host while the request waited for the store is concurrent with it, and need
        not apply to it; comparing with the board at the end refused such requests (503) while
        keys changed often, though the store had brought everything they had to see."""
        keyring = self.keyring
        if enforced is None:
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
        enforced = int(self.board.cell[0])
        if enforced > self.keyring.generation:
            self.refresh(force=True)
        return self.caught_up(enforced)

    def reload(self) -> bool:
        """Read the store now (SIGHUP). True when the stored keyring is the one served."""
        self.refresh(force=True)
        return self.store_error is None

    def _reload_outcome(self, error: str | None) -> None:
        changed = error != self.last_reload_error
        self.last_reload_error = error
        if error is not None and changed:
            log.error("keyring refused; keeping the previous keyring", extra={"reason": error})
        if self._on_reload is not None and (changed or error is None):
            self._on_reload(error is None)

    # Changing it --------------------------------------------------------------------------

    def apply(self, change: Callable[[KeyringDocument], R]) -> tuple[Keyring, R]:
        """One change in one store transaction (see the module docstring): ``change`` edits
        the next document in place and returns what the caller wants back."""
        if self._read_only:
            raise Conflict("the keyring is read-only on this instance; manage keys with the CLI")
        with self._lock:
            try:
                with self.store.transaction() as transaction:
                    raw = transaction.read()
                    if raw is None:
                        raise IntegrityError(f"the keyring in {self.store.description} is gone")
                    current, master = self._open(raw)
                    check_succession(self._keyring, current, self._expected_deployment)
                    # The store is under ``master``: what ``change`` wraps must be too.
                    previous_master = None if master is self._master else self._master
                    self._adopt_master(master)
                    document = next_document(current)
                    result = change(document)
                    if (
                        document.keys == current.document.keys
                        and document.approvals == current.document.approvals
                    ):
                        # Nothing to change (a key already there, a rotation already done
                        # elsewhere): no write, no new generation; serve what is stored.
                        keyring = build_keyring(
                            current,
                            master,
                            self._keyring,
                            self._activation_delay,
                            previous_master=previous_master,
                        )
                        document, stored = current.document, raw
                    else:
                        stored, digest = seal(document, self._master)
                        keyring = build_keyring(
                            Verified(document, digest),
                            master,
                            self._keyring,
                            self._activation_delay,
                            previous_master=previous_master,
                        )
                        transaction.write(stored)
            except IntegrityError as exc:
                self._reload_outcome(str(exc))
                raise _refused(str(exc)) from None
            except StoreUnavailable as exc:
                raise _unavailable(str(exc)) from None
            except CommitUnconfirmed as exc:
                self._stamp = _UNSET  # committed: the next check reads it
                raise _unconfirmed(str(exc)) from None
            self._keyring = keyring
            self.document, self._raw = document, stored
            # Before the caller answers: from here on no worker of this host serves an older
            # snapshot (each compares the board before it uses a key).
            self.board.raise_to(keyring.generation)
            self.last_reload_error = None
            self.store_unreachable = None
            # Not the store's stamp now: another writer may have committed since, and a stamp
            # of its change beside this snapshot would make the next checks skip reading it
            # (a worker stuck one change behind, refusing while the board is ahead). The next
            # check reads the store once.
            self._stamp = _UNSET
            log.info(
                "keyring changed",
                extra={"generation": keyring.generation, "keys": len(keyring), "pid": os.getpid()},
            )
            return keyring, result

    def rotate_master(self, new: MasterKey) -> Keyring:
        """Rewrap every version of every key under ``new`` in one store transaction (one
        atomic file replace, or one PostgreSQL transaction), one generation up and tagged
        with ``new``'s id; then serve under ``new``. Before the commit the store is entirely
        under the old key, after it entirely under the new one. A store already under
        ``new`` (a rotation finished by another process) is left as it is."""
        if self._read_only:
            raise Conflict("the keyring is read-only on this instance")
        with self._lock:
            try:
                with self.store.transaction() as transaction:
                    raw = transaction.read()
                    if raw is None:
                        raise IntegrityError(f"the keyring in {self.store.description} is gone")
                    if raw.get("master_key_id") == new.key_id:
                        current = open_document(raw, new)
                        check_succession(self._keyring, current, self._expected_deployment)
                        keyring = build_keyring(
                            current,
                            new,
                            self._keyring,
                            self._activation_delay,
                            previous_master=self._master,
                        )
                        document, stored = current.document, raw
                    else:
                        current, old = self._open(raw)
                        check_succession(self._keyring, current, self._expected_deployment)
                        document = next_document(current)
                        rewrap(document, old, new)
                        stored, digest = seal(document, new)
                        keyring = build_keyring(
                            Verified(document, digest),
                            new,
                            self._keyring,
                            self._activation_delay,
                            previous_master=old,
                        )
                        transaction.write(stored)
            except IntegrityError as exc:
                raise _refused(str(exc)) from None
            except StoreUnavailable as exc:
                raise _unavailable(str(exc)) from None
            except CommitUnconfirmed as exc:
                self._stamp = _UNSET  # committed: the next check reads it
                raise _unconfirmed(str(exc)) from None
            self._keyring = keyring
            self.document, self._raw = document, stored
            self._adopt_master(new)
            self.board.raise_to(keyring.generation)
            self.last_reload_error = None
            self.store_unreachable = None
            self._stamp = _UNSET  # as in apply(): the next check reads the store
            log.info(
                "keyring rewrapped under a new master key",
                extra={"generation": keyring.generation, "master_key_id": new.key_id},
            )
            return keyring


def _refused(reason: str) -> KeystoreUnavailable:
    log.error("key management refused: the key store failed verification", extra={"reason": reason})
    return KeystoreUnavailable(
        f"the key store failed verification ({reason}); key management is refused and "
        "nothing was changed. Crypto keeps serving the keyring loaded before. Restore the "
        "keyring from a backup (or undo the edit), then retry."
    )


def _unconfirmed(reason: str) -> KeystoreUnavailable:
    log.error("key change not confirmed by the synchronous standby", extra={"reason": reason})
    return KeystoreUnavailable(
        f"{reason}. The change is in force, but would be lost with the primary: it is not "
        "acknowledged. Read the key to see its state before repeating anything."
    )


def _unavailable(reason: str) -> KeystoreUnavailable:
    log.error("key management refused: the key store is unavailable", extra={"reason": reason})
    return KeystoreUnavailable(
        f"{reason}; nothing was changed and the keyring in memory still serves. Retry once "
        "the store is back (free space, fix permissions, or restore the database connection)."
    )
