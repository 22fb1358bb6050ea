"""Counting on the request path, flushing off it.

:meth:`UsageRecorder.record` runs on the event loop after every crypto request with the
request's results: one dictionary increment per successful item, no lock, no clock, no I/O.
Every ``interval`` seconds :meth:`UsageRecorder.flush` cuts the counts (a dictionary swap on
the loop, stamped with the time of the cut: ``last_used_at`` is therefore at most one interval
late) and a thread adds them to the store in one transaction. A failed flush keeps its counts
and retries them with the next one, merged; nothing is lost while the store is down (the
counts in memory are bounded by the number of key versions and operations, not by requests).
At shutdown the last counts are flushed; a process killed without shutdown loses at most the
counts of its last ``interval`` (plus those of an outage still being retried).

:meth:`UsageRecorder.usage` answers what this process knows: the stored totals plus its own
counts not yet stored. A batch is in exactly one of three places (counting, written, stored),
and the read holds the writer's lock while it reads the store and looks at the other two, so
a count is never seen twice or missed.

Which items count: those that succeeded (an item answered with an error used no key version
to any end; the failure counts are in ``cryptd_crypto_operations_total``). Operations:
:data:`~service.usage.store.OPERATIONS`; ``rewrap`` counts ``rewrap_from`` on the version
that decrypted and ``rewrap_to`` on the one that encrypted (of the same key or ``to_key``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from service.errors import CryptdError
from service.keys import token
from service.keys.keyring import Key, Keyring
from service.operations import MacVerifyItem, OpName, RewrapItem, VerifyItem
from service.usage.store import OPERATIONS, Increment, UsageKey, UsageStore, UsageUnavailable

log = logging.getLogger("cryptd.usage")

# Operations whose result names the version used.
_ANSWERS_VERSION = frozenset(
    {"encrypt", "decrypt", "sign", "hmac", "datakey", "encapsulate", "decapsulate"}
)

Batch = dict[UsageKey, Increment]
# Per version: operation -> count, and the latest use (None: never).
VersionUsage = dict[str, Any]
# counts(new_counts): what the metrics learn at every cut (key, version, operation, count).
CountsSink = Callable[[Mapping[UsageKey, int]], None]


class UsageRecorder:
    def __init__(
        self,
        store: UsageStore | None,
        *,
        interval: float = 2.0,
        on_counts: CountsSink | None = None,
        on_flush: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``store`` None: counts stay in this process (and reach the metrics only).
        ``on_counts`` gets each cut's new counts (the metrics); ``on_flush(ok)`` each store
        write's outcome."""
        self.store = store
        self.interval = interval
        self._on_counts = on_counts
        self._on_flush = on_flush
        self._clock = clock
        self._counts: dict[UsageKey, int] = {}
        # Cut batches not yet stored (written now, or failed and waiting for the next flush).
        self._pending: dict[int, Batch] = {}
        self._ids = itertools.count()
        self._state = threading.Lock()  # _pending; held for dictionary copies only
        self._io = threading.Lock()  # one store write at a time; a read excludes writes
        self._failing = False

    # -- the request path ---------------------------------------------------------------------

    def record(
        self, keyring: Keyring, key: Key, op: OpName, items: Sequence[Any], results: Sequence[Any]
    ) -> None:
        """Count the successful ``results`` of ``items`` (same order) run as ``op`` on ``key``."""
        counts = self._counts
        if op in _ANSWERS_VERSION:
            name, created = key.name, key.created_at
            for result in results:
                if type(result) is dict:
                    counted = (name, created, result["key_version"], op)
                    counts[counted] = counts.get(counted, 0) + 1
            return
        for item, result in zip(items, results, strict=True):
            if type(result) is dict:
                self._record_other(keyring, key, op, item, result)

    def _record_other(
        self, keyring: Keyring, key: Key, op: OpName, item: Any, result: dict[str, Any]
    ) -> None:
        counts = self._counts
        if op == "verify":
            if isinstance(item, MacVerifyItem):
                version = token.named_version(item.mac)
            elif isinstance(item, VerifyItem):
                try:
                    version = key.version(item.key_version).version
                except CryptdError:  # a version only a newer snapshot has (run again there)
                    return
            else:
                return
            if version is not None:
                counted = (key.name, key.created_at, version, "verify")
                counts[counted] = counts.get(counted, 0) + 1
        elif op == "rewrap" and isinstance(item, RewrapItem):
            source = token.named_version(item.ciphertext)
            if source is not None:
                counted = (key.name, key.created_at, source, "rewrap_from")
                counts[counted] = counts.get(counted, 0) + 1
            target = key if item.to_key is None else keyring.get(item.to_key)
            if target is not None:
                counted = (target.name, target.created_at, result["key_version"], "rewrap_to")
                counts[counted] = counts.get(counted, 0) + 1

    # -- flushing -----------------------------------------------------------------------------

    def _cut(self) -> dict[UsageKey, int]:
        """On the event loop: move the counts so far into a pending batch, stamped now."""
        counts = self._counts
        if not counts:
            return {}
        at = self._clock()
        with self._state:  # a reader sees the counts either here or pending, never neither
            self._counts = {}
            self._pending[next(self._ids)] = {k: (n, at) for k, n in counts.items()}
        return counts

    def _write(self, fresh: Mapping[UsageKey, int]) -> None:
        """In a thread: publish the new counts to the metrics, then store every pending batch,
        merged, in one transaction."""
        if fresh and self._on_counts is not None:
            try:
                self._on_counts(fresh)
            except Exception as exc:  # the metrics must not stop the counts reaching the store
                log.error("usage metrics failed", extra={"error_type": type(exc).__name__})
        if self.store is None:
            with self._state:
                self._pending.clear()
            return
        with self._io:
            with self._state:
                ids = list(self._pending)
                merged = merge(self._pending[i] for i in ids)
            if not merged:
                return
            try:
                self.store.add(merged)
            except UsageUnavailable as exc:
                with self._state:  # one batch to retry, however long the outage lasts
                    for i in ids:
                        del self._pending[i]
                    self._pending[next(self._ids)] = merged
                if not self._failing:
                    log.error("usage counts not stored (kept, retried)", extra={"reason": str(exc)})
                self._failing = True
                if self._on_flush is not None:
                    self._on_flush(False)
                return
            with self._state:
                for i in ids:
                    del self._pending[i]
            if self._failing:
                log.info("usage counts stored again")
            self._failing = False
            if self._on_flush is not None:
                self._on_flush(True)

    async def flush(self) -> None:
        """Cut the counts (on the loop) and store them (in a thread)."""
        fresh = self._cut()
        if fresh or self._pending:
            await asyncio.to_thread(self._write, fresh)

    async def run(self) -> None:
        """Flush every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception as exc:
                log.error("usage flush failed", extra={"error_type": type(exc).__name__})

    async def close(self) -> None:
        """The last flush (at shutdown), then the store's connection."""
        try:
            await self.flush()
            with self._state:
                lost = sum(n for batch in self._pending.values() for n, _ in batch.values())
            if lost:  # no later flush will retry them
                log.error("usage counts lost at shutdown", extra={"operations": lost})
        finally:
            if self.store is not None:
                await asyncio.to_thread(self.store.close)

    def health(self) -> dict[str, Any]:
        """For readiness: informational (a usage store that is down refuses nothing); the
        reason is in the log, not in this unauthenticated answer."""
        return {
            "backend": "memory" if self.store is None else self.store.backend,
            "stored": not self._failing,
        }

    # -- reading ------------------------------------------------------------------------------

    async def usage(self, key: Key) -> dict[int, VersionUsage] | None:
        """Per version of ``key``: ``{"operations": {op: count}, "last_used_at": epoch |
        None}``, stored totals plus this process's counts not stored yet; None when the store
        cannot be read now."""
        if self._failing:  # the last flush could not reach the store: do not wait on it
            return None
        try:
            stored, pending, counts = await asyncio.to_thread(self._read, key)
        except UsageUnavailable as exc:
            log.warning("usage counts unreadable", extra={"reason": str(exc)})
            return None
        now = self._clock()
        mine = (key.name, key.created_at)
        entries: list[tuple[int, str, int, float]] = [
            (row.version, row.operation, row.count, row.last_used_at) for row in stored
        ]
        entries += [
            (version, operation, count, at)
            for (name, created, version, operation), (count, at) in pending.items()
            if (name, created) == mine
        ]
        entries += [
            (version, operation, count, now)
            for (name, created, version, operation), count in counts.items()
            if (name, created) == mine
        ]
        return tally(key, entries)

    def _read(self, key: Key) -> tuple[list[Any], Batch, dict[UsageKey, int]]:
        with self._io:  # no batch is stored while the store is read
            stored = [] if self.store is None else self.store.read(key.name, key.created_at)
            with self._state:  # no cut while the batches not stored are copied
                pending = merge(self._pending.values())
                counts = self._counts.copy()
        return stored, pending, counts


def tally(key: Key, entries: Iterable[tuple[int, str, int, float]]) -> dict[int, VersionUsage]:
    """Per version of ``key``, the (version, operation, count, last use) entries summed; every
    version and operation present, zero where unused."""
    versions: dict[int, VersionUsage] = {
        number: {"operations": dict.fromkeys(OPERATIONS, 0), "last_used_at": None}
        for number in key.versions
    }
    for version, operation, count, at in entries:
        entry = versions.get(version)
        if entry is None or operation not in entry["operations"]:
            continue  # a version no longer held, or an operation this build does not know
        entry["operations"][operation] += count
        last = entry["last_used_at"]
        entry["last_used_at"] = at if last is None else max(last, at)
    return versions


def as_json(usage: VersionUsage) -> dict[str, Any]:
    """One version's usage as the API shows it: counts, their total, ``last_used_at`` as
    RFC 3339 UTC (seconds, like ``created_at``) or null."""
    last = usage["last_used_at"]
    operations: dict[str, int] = usage["operations"]
    return {
        "operations": operations,
        "total": sum(operations.values()),
        "last_used_at": None
        if last is None
        else datetime.fromtimestamp(last, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def merge(batches: Any) -> Batch:
    """Batches summed: counts added, the latest use kept."""
    merged: Batch = {}
    for batch in batches:
        for key, (count, at) in batch.items():
            found = merged.get(key)
            merged[key] = (count, at) if found is None else (found[0] + count, max(found[1], at))
    return merged
