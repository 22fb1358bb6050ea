"""State of a pool worker process: it opens the key store and unwraps the keyring itself.

Key objects never cross the process boundary: tasks name a key and carry the digest of the
keyring the server worker used, and a pool process whose snapshot differs reads the store
(the same file, or its own database connection) before running.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from service import operations
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.operations import Item, Observer, OpName, Outcome
from service.seal.rotation import files_from_spec
from service.stores import open_store


class _WorkerState:
    def __init__(self, manager: KeyManager, observer: Observer | None) -> None:
        self.manager = manager
        self.observer = observer


_state: _WorkerState | None = None


def init_worker(
    keyring_path: str,
    master_key: bytes,
    activation_delay: float = 0.0,
    observer: Observer | None = None,
    keystore_url: str | None = None,
    key_files: tuple[str, ...] | None = None,
) -> None:
    """Pool initializer: load the keyring and cache every parsed key for this process. The
    arguments reach the process through a pipe, never argv or the environment."""
    global _state
    manager = KeyManager(
        open_store(keystore_url, Path(keyring_path)),
        MasterKey(master_key),
        read_only=True,
        activation_delay=activation_delay,
        # A master-key rotation: the new key is found where the seal keeps it.
        lookup=files_from_spec(key_files, master_key),
    )
    manager.load()
    _state = _WorkerState(manager, observer)


def run_chunk(digest: str, op: OpName, name: str, items: Sequence[Item]) -> list[Outcome]:
    if _state is None:
        raise RuntimeError("worker not initialised")
    manager = _state.manager
    if manager.keyring.digest != digest:
        manager.refresh(force=True)
    return operations.run_batch(manager.keyring, op, name, items, _state.observer)
