"""The key-store interface: where the keyring document lives, and nothing about what it means.

A store keeps one document (:data:`~service.keys.document.RawDocument`: every key's metadata
and wrapped material, and the document MAC) and offers five things: load the whole document;
load it again reading only the keys a change named (the rest taken from the document read
before); apply one change in a transaction (read the current document under an exclusive
lock, write the new one, committed atomically or not at all); say cheaply whether it changed;
take a named lock shared by every replica. Verification, unwrapping and the MAC live above it
(:mod:`service.keys.integrity`): a store never decides what is valid.

Backends, one module each: :mod:`service.keys.filestore` (a JSON file, the default) and
:mod:`service.keys.pgstore` (PostgreSQL, shared by replicas). :func:`service.stores.open_store`
picks one; this interface imports neither.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Collection, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from service.keys.document import RawDocument


class KeystoreError(Exception):
    """Base of the store errors. Messages are safe to show an operator: they name places and
    causes, never key material or credentials."""


class StoreUnavailable(KeystoreError):
    """The store cannot be read or written now (I/O error, full disk, database down); trying
    again later may succeed. Nothing was changed."""


class CommitUnconfirmed(KeystoreError):
    """The change committed on the primary, but the synchronous standby never confirmed it
    (the wait for it was cancelled): in force, and lost if the primary is lost now."""


class IntegrityError(KeystoreError):
    """What the store holds is refused: malformed, failing its MAC, under another master key,
    another deployment's, or older than what this process already serves."""


class NotInitialised(KeystoreError):
    """The store holds no keyring yet (``cryptd keystore init`` makes one)."""


@dataclass(frozen=True, slots=True)
class Changed:
    """The stored keyring changed to ``generation``; None: it may have (a notification may have
    been missed while the channel was (re)connecting). ``keys``: the keys whose stored rows
    that change wrote or removed; None: not said (too many to name, or an older writer). A
    hint for reading less, never trusted: what is read is verified against the MAC over the
    whole document all the same."""

    generation: int | None = None
    keys: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Announced:
    """Replica ``replica`` enforces keyring ``generation`` (service/keys/propagation.py)."""

    replica: str
    generation: int


Notice = Changed | Announced


@dataclass(frozen=True, slots=True)
class ServerClock:
    """The store server's wall clock, read in a statement this host runs anyway (the lease's
    announcement): ``server_time`` (epoch seconds) read somewhere between ``sent`` (this host's
    monotonic clock when the statement left) and ``sent + round_trip`` (monotonic seconds until
    its answer was read). ``reference`` names what was read, for readiness and its operator."""

    reference: str
    server_time: float
    sent: float
    round_trip: float


class Transaction(Protocol):
    def read(self) -> RawDocument | None:
        """The current document, read under the transaction's exclusive lock (None: empty)."""

    def write(self, document: RawDocument) -> None:
        """Replace the document; committed when the transaction ends without an error."""


class KeyStore(Protocol):
    @property
    def description(self) -> str:
        """Where the keyring lives, for logs and readiness (never a password)."""

    @property
    def backend(self) -> str:
        """``file`` or ``postgresql``."""

    def read(self) -> RawDocument | None:
        """The whole document, consistent (None: nothing stored yet)."""

    def read_keys(self, base: RawDocument, names: Collection[str]) -> RawDocument | None:
        """The document as stored now, reading only its header (MAC included), its approvals
        and the rows of the keys ``names``; every other key as in ``base`` (a document this
        process read and verified before; never changed). Right only when no other key
        changed since ``base``: the caller verifies the MAC over the whole result and reads
        everything when it fails. A store without rows to pick returns :meth:`read`."""

    def stamp(self) -> Hashable:
        """Changes whenever the stored document changes; cheap (a stat, one small query)."""

    def transaction(self) -> AbstractContextManager[Transaction]:
        """One change: exclusive across processes and replicas, atomic."""

    def try_lock(self, purpose: str) -> AbstractContextManager[bool]:
        """A lock named ``purpose`` held by at most one process of every replica sharing the
        store; yields False at once when another holds it."""

    def notifications(self) -> AsyncGenerator[Notice, None] | None:
        """Push notifications of changes and replicas' announcements, or None when the store
        has no channel (then the stamp is polled). Yields ``Changed(None)`` after every
        (re)connection too: a change may have been missed."""

    def announce(self, replica: str, generation: int) -> None:
        """Tell every replica listening that ``replica`` enforces ``generation`` (nothing
        where the store has no channel)."""

    def server_clock(self) -> ServerClock | None:
        """The server's clock as the last announcement read it: a second reference for this
        host's clock, independent of the replay store's (service/auth/clock.py). None: the
        store has no server of its own (the keyring file), or none was read yet."""

    def remove_leftovers(self) -> int:
        """Remove what a killed writer left behind (the file store's temporary copies of the
        keyring), safely while other processes use the store; the number removed."""

    def close(self) -> None: ...
