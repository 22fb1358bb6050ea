"""Replay protection: remember each ``(keyid, nonce)`` for as long as its signature is valid.

:class:`MemoryReplayStore` serves one process; :class:`RedisReplayStore` lets replicas (and
server worker processes) share what they have seen. Only authenticated requests reach a
store, so an attacker cannot fill it with nonces of requests it could not sign.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol

import redis.exceptions

from service.auth.coalesce import Coalescer
from service.auth.redis_client import SerialConnection

if TYPE_CHECKING:
    from redis.asyncio import Redis

KEY_PREFIX: Final = "cryptd:nonce:"
DEFAULT_MAX_ENTRIES: Final = 1_000_000


class StoreUnavailable(Exception):
    """The store cannot answer (Redis down or too slow, memory store full)."""


class ReplayStore(Protocol):
    async def remember(self, keyid: str, nonce: str, ttl: int) -> bool:
        """Record the pair for ``ttl`` seconds. True the first time, False for a replay.

        Raises :class:`StoreUnavailable` when it cannot tell.
        """
        ...

    async def ping(self) -> bool:
        """Whether the store answers (readiness)."""
        ...

    async def aclose(self) -> None:
        """Release connections (shutdown)."""
        ...


class MemoryReplayStore:
    """In-process store: key -> expiry second, plus one bucket of keys per expiry second.

    Purging walks whole buckets in time order (a heap of a few hundred seconds, not of every
    entry), so an entry costs one dict slot and one list slot beside its key. Expiry is
    rounded up to the next second: a nonce may be kept up to a second longer, never shorter.
    Memory is bounded: beyond ``max_entries`` live entries the store refuses
    (StoreUnavailable) rather than forget a nonce early.
    """

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._expiry: dict[str, int] = {}
        self._buckets: dict[int, list[str]] = {}
        self._seconds: list[int] = []  # heap of the buckets' expiry seconds

    async def remember(self, keyid: str, nonce: str, ttl: int) -> bool:
        return self.remember_now(keyid, nonce, ttl, time.monotonic())

    def remember_now(self, keyid: str, nonce: str, ttl: int, now: float) -> bool:
        self._purge(now)
        key = f"{keyid}:{nonce}"  # a client id holds no ':'
        if key in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise StoreUnavailable("replay store full")
        expires = math.ceil(now + ttl)
        self._expiry[key] = expires
        bucket = self._buckets.get(expires)
        if bucket is None:
            bucket = self._buckets[expires] = []
            heapq.heappush(self._seconds, expires)
        bucket.append(key)
        return True

    def _purge(self, now: float) -> None:
        seconds, expiry = self._seconds, self._expiry
        while seconds and seconds[0] <= now:
            second = heapq.heappop(seconds)
            for key in self._buckets.pop(second):
                if expiry.get(key) == second:
                    del expiry[key]

    def __len__(self) -> int:
        return len(self._expiry)

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


# KEYS: nonce keys; ARGV: their TTLs in seconds. Returns 1 (first time) or 0 per key.
_SET_MANY_SCRIPT: Final = """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, '1', 'NX', 'EX', ARGV[i]) then out[i] = 1 else out[i] = 0 end
end
return out
"""
# Redis names scripts by their SHA-1 (an identifier, not a security function).
_SET_MANY_SHA: Final = hashlib.sha1(_SET_MANY_SCRIPT.encode(), usedforsecurity=False).hexdigest()


class RedisReplayStore:
    """Shared store: ``SET cryptd:nonce:<keyid>:<nonce> 1 NX EX ttl`` is atomic across replicas.

    Pass a client built by :func:`service.auth.redis_client.connect` (short timeouts, one quick
    retry): a dead Redis then costs milliseconds per request, not seconds, and redis-py
    reconnects by itself when it returns. The nonces of concurrent requests go to Redis
    together: one Lua script runs the SETs of a whole batch (:mod:`service.auth.coalesce`),
    ~7 us of CPU per nonce instead of ~100 us. A script touches keys of many clients, so the
    store needs a standalone Redis (or one shard), not Redis Cluster.
    """

    def __init__(self, client: Redis, *, prefix: str = KEY_PREFIX) -> None:
        self._redis = client
        self._connection = SerialConnection(client)
        self._prefix = prefix
        self._coalescer: Coalescer[tuple[str, int], int] = Coalescer(self._set_many)

    async def remember(self, keyid: str, nonce: str, ttl: int) -> bool:
        # keyid is a client id ([A-Za-z0-9_.-], no ':'), so the key is unambiguous.
        key = f"{self._prefix}{keyid}:{nonce}"
        try:
            return bool(await self._coalescer.submit((key, max(1, ttl))))
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            # Connection refused or lost, timeout, READONLY during a failover, OOM, ...
            raise StoreUnavailable(type(exc).__name__) from exc

    async def _set_many(self, items: Sequence[tuple[str, int]]) -> list[int]:
        keys = [key for key, _ in items]
        args = [*keys, *(ttl for _, ttl in items)]
        (replies,) = await self._connection.pipeline([("EVALSHA", _SET_MANY_SHA, len(keys), *args)])
        if isinstance(replies, redis.exceptions.NoScriptError):  # Redis restarted or flushed
            (replies,) = await self._connection.pipeline(
                [("EVAL", _SET_MANY_SCRIPT, len(keys), *args)]
            )
        if isinstance(replies, Exception):
            raise replies
        return [int(reply) for reply in replies]

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            return False

    async def aclose(self) -> None:
        await self._connection.aclose()
