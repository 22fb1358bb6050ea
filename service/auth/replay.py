"""Replay protection: remember each ``(keyid, nonce)`` for as long as its signature is valid.

:class:`MemoryReplayStore` serves one process; :class:`RedisReplayStore` lets replicas (and
server worker processes) share what they have seen; :class:`~service.auth.replay_host.
HostReplayStore` lets the worker processes of one host share it without a server. Only
authenticated requests reach a store, so an attacker cannot fill it with nonces of requests
it could not sign.

A store that starts empty while requests were accepted before it existed (Redis restarted, a
new host store) cannot tell those requests' replays from fresh ones. Redis and the host store
therefore keep an *epoch*, the time they started, and refuse every request created before
``epoch + max_skew`` (:class:`StoreRecovering`): a request accepted earlier was created at
most ``max_skew`` seconds ahead of its acceptance, so none of them is accepted again.
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
from service.auth.signature import DEFAULT_MAX_SKEW

if TYPE_CHECKING:
    from redis.asyncio import Redis

KEY_PREFIX: Final = "cryptd:nonce:"
DEFAULT_MAX_ENTRIES: Final = 1_000_000


class StoreUnavailable(Exception):
    """The store cannot answer (Redis down or too slow, store full)."""


class StoreRecovering(StoreUnavailable):
    """The store started after the request was created: it could be the replay of a request
    accepted before the store existed, so the store cannot vouch for it (503, never
    fail-open). ``retry_after``: seconds until a request signed anew is past the epoch."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"request created before the replay store's epoch ({retry_after} s)")
        self.retry_after = min(max(1, retry_after), 3600)


class ReplayStore(Protocol):
    backend: str  # "memory", "host" or "redis" (readiness)

    async def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> bool:
        """Record the pair for ``ttl`` seconds. True the first time, False for a replay.

        ``created`` is the request's signature time. Raises :class:`StoreUnavailable` when
        the store cannot tell, :class:`StoreRecovering` when ``created`` precedes its epoch.
        """
        ...

    async def ping(self) -> bool:
        """Whether the store answers and accepts requests signed now (readiness)."""
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
    (StoreUnavailable) rather than forget a nonce early. It has no epoch: it lives and dies
    with its process, which is the only one accepting requests with it.
    """

    backend = "memory"

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._expiry: dict[str, int] = {}
        self._buckets: dict[int, list[str]] = {}
        self._seconds: list[int] = []  # heap of the buckets' expiry seconds

    async def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> bool:
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


# KEYS[1]: the store's epoch key; KEYS[2..]: nonce keys. ARGV[1]: the maximum skew (s); then,
# per nonce key, its TTL and its request's created time. Returns, per nonce: 1 the first time,
# 0 for a replay, a negative -n for a request created n seconds before epoch + skew (refused).
# The epoch is this Redis's first script call: Redis's clock, rounded up, set once (NX) and
# never expiring, so it disappears only with every nonce (a restart, a flush).
_SET_MANY_SCRIPT: Final = """
local now = redis.call('TIME')
redis.call('SET', KEYS[1], tostring(tonumber(now[1]) + 1), 'NX')
local floor = tonumber(redis.call('GET', KEYS[1])) + tonumber(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local created = tonumber(ARGV[2 * i - 1])
  if created < floor then
    out[i - 1] = created - floor
  elseif redis.call('SET', KEYS[i], '1', 'NX', 'EX', ARGV[2 * i - 2]) then
    out[i - 1] = 1
  else
    out[i - 1] = 0
  end
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
    ~7 us of CPU per nonce instead of ~100 us. The same script keeps the epoch
    (``<prefix>epoch``), so every batch sees the epoch it is checked against atomically. A
    script touches keys of many clients, so the store needs a standalone Redis (or one
    shard), not Redis Cluster.
    """

    backend = "redis"

    def __init__(
        self, client: Redis, *, prefix: str = KEY_PREFIX, max_skew: int = DEFAULT_MAX_SKEW
    ) -> None:
        self._redis = client
        self._connection = SerialConnection(client)
        self._prefix = prefix
        # No client id is "epoch" followed by nothing: nonce keys always have a second ':'.
        self._epoch_key = f"{prefix}epoch"
        self._max_skew = max_skew
        self._coalescer: Coalescer[tuple[str, int, int], int] = Coalescer(self._set_many)

    async def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> bool:
        # keyid is a client id ([A-Za-z0-9_.-], no ':'), so the key is unambiguous.
        key = f"{self._prefix}{keyid}:{nonce}"
        try:
            verdict = await self._coalescer.submit((key, max(1, ttl), created))
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            # Connection refused or lost, timeout, READONLY during a failover, OOM, ...
            raise StoreUnavailable(type(exc).__name__) from exc
        if verdict < 0:
            raise StoreRecovering(-verdict)
        return bool(verdict)

    async def _set_many(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        keys = [self._epoch_key, *(key for key, _, _ in items)]
        args = [self._max_skew, *(value for _, ttl, created in items for value in (ttl, created))]
        command = (len(keys), *keys, *args)
        (replies,) = await self._connection.pipeline([("EVALSHA", _SET_MANY_SHA, *command)])
        if isinstance(replies, redis.exceptions.NoScriptError):  # Redis restarted or flushed
            (replies,) = await self._connection.pipeline([("EVAL", _SET_MANY_SCRIPT, *command)])
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
