"""Runs engine operations on the executor chosen for the key's type.

Batches are cut into chunks, one task per chunk, so one round trip to a worker carries many
operations. Inline work yields to the event loop between chunks so a large batch of cheap
operations cannot stall other requests. Key types in ``single_inline`` run a lone item on the
event loop (no hand-off) and their batches on their executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from service import engine, worker
from service.engine import Item, Observer, OpName, Outcome
from service.errors import Overloaded
from service.keys.manager import KeyManager
from service.pool.base import Executor


class CryptoRunner:
    def __init__(
        self,
        keys: KeyManager,
        executors: Mapping[str, Executor],
        *,
        single_inline: frozenset[str] = frozenset(),
        chunk_size: int,
        observer: Observer | None = None,
        on_overload: Callable[[], None] | None = None,
    ) -> None:
        self._keys = keys
        self._executors = executors
        self._single_inline = single_inline
        self._chunk_size = chunk_size
        self._observer = observer
        self._on_overload = on_overload

    async def run(self, op: OpName, name: str, items: Sequence[Item]) -> list[Outcome]:
        keyring = self._keys.keyring
        key = keyring.key(name)
        engine.check_operation(key, op)
        if not items:
            return []
        executor = self._executors[key.type.name]
        if len(items) == 1 and (executor.kind == "inline" or key.type.name in self._single_inline):
            return engine.run_items(keyring, key, op, items, self._observer)
        size = self._chunk_size
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        if executor.kind == "inline":
            results: list[Outcome] = []
            for index, chunk in enumerate(chunks):
                if index:
                    await asyncio.sleep(0)
                results += engine.run_items(keyring, key, op, chunk, self._observer)
            return results
        if executor.kind == "process":
            tasks = [
                executor.run(worker.run_chunk, keyring.generation, op, name, chunk)
                for chunk in chunks
            ]
        else:
            tasks = [
                executor.run(engine.run_batch, keyring, op, name, chunk, self._observer)
                for chunk in chunks
            ]
        try:
            if len(tasks) == 1:
                return await tasks[0]
            parts = await asyncio.gather(*tasks)
        except Overloaded:
            if self._on_overload is not None:
                self._on_overload()
            raise
        return [outcome for part in parts for outcome in part]
