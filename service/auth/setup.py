"""Build the authentication parts from :class:`~service.config.Settings` (used by the app)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.auth.clients import ClientsFile
from service.auth.ratelimit import MemoryRateLimiter, RateLimiter, RedisRateLimiter
from service.auth.ratelimit_host import HostRateLimiter
from service.auth.redis_client import (
    REDIS_ERRORS,
    RedisClient,
    RedisTarget,
    check_target,
    close,
    open_client,
    parse_url,
)
from service.auth.replay import MemoryReplayStore, RedisReplayStore, ReplayStore
from service.auth.replay_host import HostReplayStore
from service.config import Settings

log = logging.getLogger("cryptd.auth")


@dataclass
class AuthParts:
    """What :class:`~service.auth.authenticator.Authenticator` needs, plus the Redis
    client to close at shutdown."""

    clients: ClientsFile
    replay: ReplayStore
    rate_limiter: RateLimiter | None
    redis: RedisClient | None
    redis_target: RedisTarget | None = None

    async def start(self) -> None:
        """At server start: refuse a Redis URL that can never work
        (:class:`~service.auth.redis_client.RedisConfigError`), and establish the replay
        store's epoch now rather than at the first request, so that its refusal window runs
        while readiness says so (an unreachable Redis is only logged: readiness reports it)."""
        if self.redis is None or self.redis_target is None:
            return
        await check_target(self.redis, self.redis_target)
        if not isinstance(self.replay, RedisReplayStore):
            return
        try:
            health = await self.replay.establish()
        except REDIS_ERRORS as exc:
            log.error(
                "replay store unreachable at start (%s); signed requests get 503 until it answers",
                type(exc).__name__,
                extra={"redis": self.redis_target.describe()},
            )
            return
        if health.reason is not None:
            log.warning("%s", health.reason)

    async def aclose(self) -> None:
        await self.replay.aclose()
        if self.rate_limiter is not None:
            await self.rate_limiter.aclose()
        if self.redis is not None:
            await close(self.redis)


def build_auth(
    settings: Settings,
    clients_file: Path | None = None,
    *,
    clock: Callable[[], float] = time.time,
) -> AuthParts:
    """Replay store and rate limiter in Redis when ``CRYPTD_REDIS_URL`` is set; else both in
    ``CRYPTD_REPLAY_DIR`` (shared by the host's workers) or, without one, in memory (one
    process). ``clients_file`` overrides
    ``settings.clients_file`` (the development setup writes its own); ``clock``: the one
    signatures are checked against, which a Redis store measures against its own."""
    path = clients_file or settings.clients_file
    if path is None:
        raise ValueError("CRYPTD_CLIENTS_FILE is not set")
    target = parse_url(settings.redis_url) if settings.redis_url else None
    client = open_client(settings.redis_url) if settings.redis_url else None
    return AuthParts(
        ClientsFile(path),
        replay_store(settings, client, clock=clock),
        _limiter(settings, client),
        client,
        target,
    )


def check_redis_url(url: str) -> None:
    """Before any worker starts: refuse a ``CRYPTD_REDIS_URL`` that can never work with its
    reason (:class:`~service.auth.redis_client.RedisConfigError`), once, instead of each
    worker failing on it in turn."""

    async def check() -> None:
        client = open_client(url)
        try:
            await check_target(client, parse_url(url))
        finally:
            await close(client)

    asyncio.run(check())


def replay_store(
    settings: Settings, redis: RedisClient | None, *, clock: Callable[[], float] = time.time
) -> ReplayStore:
    skew = settings.signature_max_skew
    if redis is not None:
        return RedisReplayStore(
            redis, max_skew=skew, max_age=settings.signature_max_age, clock=clock
        )
    if settings.replay_dir is not None:
        return HostReplayStore(
            settings.replay_dir,
            max_age=settings.signature_max_age,
            max_skew=skew,
            max_bytes=settings.replay_max_bytes,
        )
    return MemoryReplayStore()


def _limiter(settings: Settings, redis: RedisClient | None) -> RateLimiter | None:
    if settings.rate_limit_per_second <= 0:
        return None
    rate, burst = settings.rate_limit_per_second, settings.rate_limit_burst
    if redis is not None:
        return RedisRateLimiter(redis, rate, burst)
    if settings.replay_dir is not None:  # every worker of the host shares the buckets
        return HostRateLimiter(settings.replay_dir, rate, burst)
    return MemoryRateLimiter(rate, burst)
