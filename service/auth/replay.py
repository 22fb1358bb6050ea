"""Replay protection: remember each ``(keyid, nonce)`` for as long as its signature is valid.

:class:`MemoryReplayStore` serves one process; :class:`RedisReplayStore` lets replicas (and
server worker processes) share what they have seen. Only authenticated requests reach a
store, so an attacker cannot fill it with nonces of requests it could not sign.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Final, Protocol

import redis.exceptions

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


class MemoryReplayStore:
    """In-process store: a dict of expiry times plus a heap to purge them in order.

    Memory is bounded: expired entries are purged as time passes, and beyond ``max_entries``
    live entries the store refuses (StoreUnavailable) rather than forget a nonce early.
    """

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._expiry: dict[tuple[str, str], float] = {}
        self._heap: list[tuple[float, tuple[str, str]]] = []

    async def remember(self, keyid: str, nonce: str, ttl: int) -> bool:
        return self.remember_now(keyid, nonce, ttl, time.monotonic())

    def remember_now(self, keyid: str, nonce: str, ttl: int, now: float) -> bool:
        self._purge(now)
        key = (keyid, nonce)
        if key in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise StoreUnavailable("replay store full")
        expires = now + ttl
        self._expiry[key] = expires
        heapq.heappush(self._heap, (expires, key))
        return True

    def _purge(self, now: float) -> None:
        heap, expiry = self._heap, self._expiry
        while heap and heap[0][0] <= now:
            expires, key = heapq.heappop(heap)
            if expiry.get(key) == expires:
                del expiry[key]

    def __len__(self) -> int:
        return len(self._expiry)

    async def ping(self) -> bool:
        return True


class RedisReplayStore:
    """Shared store: ``SET cryptd:nonce:<keyid>:<nonce> 1 NX EX ttl`` is atomic across replicas.

    Pass a client built by :func:`service.auth.redis_client.connect` (short timeouts, one quick
    retry): a dead Redis then costs milliseconds per request, not seconds, and redis-py
    reconnects by itself when it returns.
    """

    def __init__(self, client: Redis, *, prefix: str = KEY_PREFIX) -> None:
        self._redis = client
        self._prefix = prefix

    async def remember(self, keyid: str, nonce: str, ttl: int) -> bool:
        # keyid is a client id ([A-Za-z0-9_.-], no ':'), so the key is unambiguous.
        key = f"{self._prefix}{keyid}:{nonce}"
        try:
            created = await self._redis.set(key, b"1", nx=True, ex=max(1, ttl))
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(type(exc).__name__) from exc
        return bool(created)

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            return False
