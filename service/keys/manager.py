"""The key manager: one object for the application, made of four parts with one job each.

- :class:`~service.keys.snapshot.Snapshot`: the keyring this process serves, loaded and
  refreshed from the store, and the one way a change is committed;
- :class:`~service.keys.mutations.KeyMutations`: create, rotate, update, delete, cancel;
- :class:`~service.keys.transfer.KeyTransfer`: export, import, backup, restore;
- :class:`~service.keys.schedule.KeySchedule`: automatic rotation, destruction after the
  waiting period.

It receives a :class:`~service.keys.store.KeyStore` (opened by the wiring:
:mod:`service.stores`) and reaches storage only through it.
"""

from __future__ import annotations

from collections.abc import Callable

from service.keys.board import Board
from service.keys.keyring import Keyring
from service.keys.masterkey import MasterKey, MasterKeySource
from service.keys.mutations import MAX_AUTO_ROTATE_PERIOD as MAX_AUTO_ROTATE_PERIOD
from service.keys.mutations import MIN_AUTO_ROTATE_PERIOD as MIN_AUTO_ROTATE_PERIOD
from service.keys.mutations import KeyMutations
from service.keys.schedule import KeySchedule
from service.keys.snapshot import Snapshot
from service.keys.store import KeyStore
from service.keys.transfer import KeyExport as KeyExport
from service.keys.transfer import KeyTransfer


class KeyManager:
    def __init__(
        self,
        store: KeyStore,
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
        lookup: MasterKeySource | None = None,
    ) -> None:
        """``deletion_waiting_period`` (seconds): 0 deletes at once; above, :meth:`delete`
        schedules the deletion that :meth:`run_due` carries out once the date has passed.
        ``on_destroy(name, deletion_date)`` is told of every key whose material this process
        destroyed (for the audit log). ``board``: the generation board this host's workers
        share (service/keys/board.py); raised with every snapshot this process verifies or
        commits, so a change is in force on every sibling before it is answered. ``lookup``: finds
        the master key a store rotated by another process names (service/seal/rotation.py)."""
        self.store = store
        self.board = board if board is not None else Board()
        self.snapshot = Snapshot(
            store,
            master,
            self.board,
            read_only=read_only,
            activation_delay=activation_delay,
            on_reload=on_reload,
            expected_deployment=expected_deployment,
            lookup=lookup,
        )
        self.mutations = KeyMutations(
            self.snapshot,
            min_auto_rotate_period=min_auto_rotate_period,
            deletion_waiting_period=deletion_waiting_period,
            on_destroy=on_destroy,
        )
        self.transfer = KeyTransfer(self.snapshot, on_destroy)
        self.schedule = KeySchedule(self.snapshot, on_destroy)

        # The snapshot: what is served, read from the store.
        self.load = self.snapshot.load
        self.refresh = self.snapshot.refresh
        self.heard = self.snapshot.heard
        self.caught_up = self.snapshot.caught_up
        self.current = self.snapshot.current
        self.reload = self.snapshot.reload
        # Changes.
        self.create = self.mutations.create
        self.rotate = self.mutations.rotate
        self.update = self.mutations.update
        self.update_with_previous = self.mutations.update_with_previous
        self.delete = self.mutations.delete
        self.cancel_deletion = self.mutations.cancel_deletion
        self.ensure_internal_key = self.mutations.ensure_internal_key
        # Whole keys in and out.
        self.export_key = self.transfer.export_key
        self.import_key = self.transfer.import_key
        self.backup = self.transfer.backup
        self.restore = self.transfer.restore
        # Work due with time.
        self.due_for_rotation = self.schedule.due_for_rotation
        self.due_for_destruction = self.schedule.due_for_destruction
        self.has_due_work = self.schedule.has_due_work
        self.rotate_due = self.schedule.rotate_due
        self.run_due = self.schedule.run_due

    @property
    def master(self) -> MasterKey:
        """The master key the store is under (changed by a master-key rotation)."""
        return self.snapshot.master

    _master = master  # the name tests and older callers use

    @property
    def keyring(self) -> Keyring:
        return self.snapshot.keyring

    @property
    def store_error(self) -> str | None:
        return self.snapshot.store_error

    @property
    def last_reload_error(self) -> str | None:
        return self.snapshot.last_reload_error

    @property
    def store_unreachable(self) -> str | None:
        return self.snapshot.store_unreachable
