"""State of a pool worker process: it loads and unwraps the keyring itself, once.

Key objects never cross the process boundary: tasks name a key and carry the keyring generation
the server saw, and a worker whose snapshot is older reloads from the file before running.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from service import engine
from service.engine import Item, Observer, OpName, Outcome
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey


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
) -> None:
    """Pool initializer: load the keyring and cache every parsed key for this process."""
    global _state
    manager = KeyManager(
        Path(keyring_path),
        MasterKey(master_key),
        read_only=True,
        activation_delay=activation_delay,
    )
    manager.load()
    _state = _WorkerState(manager, observer)


def run_chunk(generation: str, op: OpName, name: str, items: Sequence[Item]) -> list[Outcome]:
    if _state is None:
        raise RuntimeError("worker not initialised")
    manager = _state.manager
    if manager.keyring.generation != generation:
        manager.reload_if_changed()
    return engine.run_batch(manager.keyring, op, name, items, _state.observer)


def reload_keyring() -> None:
    """Broadcast target: pick up a changed keyring file now."""
    if _state is not None:
        _state.manager.reload_if_changed()
