"""Per-client token buckets: ``rate`` requests per second on average, bursts up to ``burst``.

In memory for one process; in Redis (one atomic Lua script, Redis's clock) when replicas
share the limit: one Redis, the primary Sentinel names, or a Redis Cluster (a bucket is one key,
so it lives on one slot). If Redis cannot answer, the limiter falls back to the in-memory buckets of
this process - a rate limit is a guard against runaway clients, not an authentication check,
so it degrades rather than failing every request.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import TYPE_CHECKING, Final, Protocol

import redis.exceptions

from service.auth.redis_client import REDIS_ERRORS, PipelineBatcher
from service.errors import RateLimited

if TYPE_CHECKING:
    from service.auth.redis_client import RedisClient

logger = logging.getLogger("cryptd.auth")

KEY_PREFIX: Final = "cryptd:ratelimit:"


class RateLimiter(Protocol):
    async def acquire(self, client_id: str) -> None:
        """Take one token for ``client_id`` or raise :class:`~service.errors.RateLimited`."""
        ...

    async def aclose(self) -> None:
        """Release connections (shutdown)."""
        ...


def default_burst(rate: float, burst: int) -> int:
    """``burst`` if set, else one second's worth of requests (at least 1)."""
    return burst if burst > 0 else max(1, math.ceil(rate))


class MemoryRateLimiter:
    """Token buckets in this process, keyed by client id (bounded by the configured clients)."""

    def __init__(self, rate: float, burst: int = 0) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive (a rate of 0 disables limiting: use None)")
        self.rate = rate
        self.burst = default_burst(rate, burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    async def acquire(self, client_id: str) -> None:
        self.acquire_now(client_id, time.monotonic())

    async def aclose(self) -> None:
        return None

    def acquire_now(self, client_id: str, now: float) -> None:
        tokens, at = self._buckets.get(client_id, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[client_id] = (tokens, now)
            raise RateLimited(retry_after=(1.0 - tokens) / self.rate)
        self._buckets[client_id] = (tokens - 1.0, now)


# KEYS[1] bucket; ARGV rate, burst. Returns {allowed (0/1), seconds to wait (string)}.
# Redis's own clock keeps replicas with skewed clocks consistent.
_BUCKET_SCRIPT: Final = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1])
local at = tonumber(state[2])
if tokens == nil or at == nil then
  tokens = burst
  at = now
end
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local allowed = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens),
           'at', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, string.format('%.6f', wait)}
"""
# Redis names scripts by their SHA-1 (an identifier, not a security function).
_BUCKET_SHA: Final = hashlib.sha1(_BUCKET_SCRIPT.encode(), usedforsecurity=False).hexdigest()


class RedisRateLimiter:
    """Token buckets shared by every replica through Redis (one EVALSHA per request, sent in
    the pipelines of a :class:`~service.auth.redis_client.PipelineBatcher`)."""

    def __init__(
        self,
        client: RedisClient,
        rate: float,
        burst: int = 0,
        *,
        prefix: str = KEY_PREFIX,
        batcher: PipelineBatcher | None = None,
    ) -> None:
        self._fallback = MemoryRateLimiter(rate, burst)
        self.rate, self.burst = self._fallback.rate, self._fallback.burst
        self._prefix = prefix
        self._batcher = batcher or PipelineBatcher(client)
        self._degraded = False

    async def acquire(self, client_id: str) -> None:
        try:
            allowed, wait = await self._run(self._prefix + client_id)
        except REDIS_ERRORS as exc:
            if not self._degraded:
                self._degraded = True
                logger.warning(
                    "rate limiter: Redis unavailable (%s); limiting per process until it returns",
                    type(exc).__name__,
                )
            await self._fallback.acquire(client_id)
            return
        if self._degraded:
            self._degraded = False
            logger.warning("rate limiter: Redis reachable again")
        if not int(allowed):
            raise RateLimited(retry_after=float(wait))

    async def _run(self, key: str) -> tuple[int, bytes]:
        command = ("EVALSHA", _BUCKET_SHA, 1, key, repr(self.rate), self.burst)
        reply = await self._batcher.execute(*command)
        if isinstance(reply, redis.exceptions.NoScriptError):  # Redis restarted or flushed
            # The script itself (then cached): on a Cluster it reaches the bucket's node.
            reply = await self._batcher.execute("EVAL", _BUCKET_SCRIPT, *command[2:])
        if isinstance(reply, Exception):
            raise reply
        allowed, wait = reply
        return int(allowed), wait

    async def aclose(self) -> None:
        await self._batcher.aclose()
