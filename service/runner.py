"""Runs engine operations on the executor chosen for the key's type.

Batches are cut into chunks, one task per chunk, so one round trip to a worker carries many
operations. Inline work yields to the event loop between chunks so a large batch of cheap
operations cannot stall other requests. Key types in ``single_inline`` run a lone item on the
event loop (no hand-off) and their batches on their executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from service import operations, pool_tasks
from service.batchcost import BatchLimits
from service.errors import KeyNotFound, Overloaded
from service.keys.keyring import Key, Keyring
from service.keys.lease import Lease
from service.keys.manager import KeyManager
from service.keys.watch import KeyringWatcher
from service.operations import Item, Observer, OpName, Outcome
from service.pool.base import Executor
from service.usage.recorder import UsageRecorder


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
        watcher: KeyringWatcher | None = None,
        usage: UsageRecorder | None = None,
        batch_limits: BatchLimits | None = None,
    ) -> None:
        """``usage`` counts every successful item (a dictionary increment, flushed later);
        ``batch_limits`` refuses (413) a batch too large for its key type before any work."""
        self._keys = keys
        self._board = keys.board.cell  # the host's generation board, read on every request
        self._watcher = watcher
        self._lease = watcher.lease if watcher is not None else Lease()  # read on every request
        self._executors = executors
        self._single_inline = single_inline
        self._chunk_size = chunk_size
        self._observer = observer
        self._on_overload = on_overload
        self._usage = usage
        self._batch_limits = batch_limits
        self._sliced_of: Keyring | None = None  # the snapshot _sliced_names was found in
        self._sliced_names: frozenset[str] = frozenset()

    def sliced(self, name: str) -> bool:
        """Whether the key called ``name`` runs its items on the sliced executor (a name this
        worker does not know: no). Asked once per request: the names are found once per
        keyring snapshot."""
        keyring = self._keys.keyring
        if keyring is not self._sliced_of:
            self._sliced_names = frozenset(
                known
                for known, key in keyring.items()
                if self._executors[key.type.name].kind == "sliced"
            )
            self._sliced_of = keyring
        return name in self._sliced_names

    async def current(self) -> Keyring:
        """The snapshot to serve: never older than a change acknowledged on this host."""
        if self._watcher is not None:
            return await self._watcher.current()
        return self._keys.current()

    async def key(self, name: str) -> tuple[Keyring, Key]:
        """The snapshot and the key called ``name``; a name this worker does not know is looked
        up in the store once before it is answered 404. A snapshot older than this host's
        board (a change committed by a sibling) is never used: the store is read first, as it
        is when this worker's lease ran out (a store shared by replicas it lost touch with)."""
        keyring = self._keys.keyring
        if self._stale(keyring):
            keyring = await self.current()
        try:
            return keyring, keyring.key(name)
        except KeyNotFound:
            if self._watcher is None:
                raise
        enforced = int(self._board[0])
        await self._watcher.after_miss(self._watcher.now())
        keyring = self._keys.caught_up(enforced)
        return keyring, keyring.key(name)

    def _stale(self, keyring: Keyring) -> bool:
        """Whether ``keyring`` must not be served before the store is read: older than this
        host's board (a sibling's commit), or this worker's lease ran out."""
        return self._board[0] > keyring.generation or not self._lease.held

    def _inline(self, key: Key, items: Sequence[Item]) -> bool:
        """Whether these items run right here on the event loop (one item of a key type run
        inline, or one whose single items are)."""
        return len(items) == 1 and (
            self._executors[key.type.name].kind == "inline" or key.type.name in self._single_inline
        )

    async def run(self, op: OpName, name: str, items: Sequence[Item]) -> list[Outcome]:
        # The usual request (a current snapshot that holds the key, one item run inline) is
        # served here without awaiting key() and _dispatch(): two coroutines fewer a request.
        keyring = self._keys.keyring
        if self._stale(keyring):
            keyring, key = await self.key(name)
        else:
            try:
                key = keyring.key(name)
            except KeyNotFound:  # key() asks the store before answering 404
                keyring, key = await self.key(name)
        operations.check_operation(key, op)
        if not items:
            return []
        if len(items) > 1 and self._batch_limits is not None:
            self._batch_limits.check(key.type.name, op, len(items))
        if self._inline(key, items):
            results = operations.run_items(keyring, key, op, items, self._observer)
        else:
            results = await self._dispatch(keyring, key, op, name, items)
        if self._watcher is not None:
            for outcome in results:
                if isinstance(outcome, KeyNotFound):
                    keyring, results = await self._again(keyring, op, name, items, results)
                    break
        usage = self._usage
        if usage is not None:
            usage.record(keyring, key, op, items, results)
        return results

    async def _again(
        self, keyring: Keyring, op: OpName, name: str, items: Sequence[Item], results: list[Outcome]
    ) -> tuple[Keyring, list[Outcome]]:
        """A version (or a rewrap target) this snapshot lacks: look in the store once, and run
        those items again if it brought a newer keyring."""
        assert self._watcher is not None
        enforced = int(self._board[0])
        await self._watcher.after_miss(self._watcher.now())
        fresh = self._keys.caught_up(enforced)
        if fresh.digest == keyring.digest or name not in fresh:
            return keyring, results
        missed = [i for i, r in enumerate(results) if isinstance(r, KeyNotFound)]
        again = await self._dispatch(fresh, fresh[name], op, name, [items[i] for i in missed])
        for index, outcome in zip(missed, again, strict=True):
            results[index] = outcome
        return fresh, results

    async def _dispatch(
        self, keyring: Keyring, key: Key, op: OpName, name: str, items: Sequence[Item]
    ) -> list[Outcome]:
        executor = self._executors[key.type.name]
        results: list[Outcome]
        if self._inline(key, items):
            return operations.run_items(keyring, key, op, items, self._observer)
        if executor.kind == "sliced":
            # One item per call: the slice is measured in items, whatever the batch.
            results = []
            for item in items:
                results += await executor.run(
                    operations.run_items, keyring, key, op, [item], self._observer
                )
            return results
        size = self._chunk_size
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        if executor.kind == "inline":
            results = []
            for index, chunk in enumerate(chunks):
                if index:
                    await asyncio.sleep(0)
                results += operations.run_items(keyring, key, op, chunk, self._observer)
            return results
        if executor.kind == "process":
            tasks = [
                executor.run(pool_tasks.run_chunk, keyring.digest, op, name, chunk)
                for chunk in chunks
            ]
        else:
            tasks = [
                executor.run(operations.run_batch, keyring, op, name, chunk, self._observer)
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
