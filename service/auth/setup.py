"""Build the authentication parts from :class:`~service.config.Settings` (used by the app)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.auth.clients import ClientsFile
from service.auth.ratelimit import MemoryRateLimiter, RateLimiter, RedisRateLimiter
from service.auth.ratelimit_host import HostRateLimiter
from service.auth.redis_client import close, connect
from service.auth.replay import MemoryReplayStore, RedisReplayStore, ReplayStore
from service.auth.replay_host import HostReplayStore
from service.config import Settings

if TYPE_CHECKING:
    from redis.asyncio import Redis


@dataclass
class AuthParts:
    """What :class:`~service.auth.authenticator.Authenticator` needs, plus the Redis
    client to close at shutdown."""

    clients: ClientsFile
    replay: ReplayStore
    rate_limiter: RateLimiter | None
    redis: Redis | None

    async def aclose(self) -> None:
        await self.replay.aclose()
        if self.rate_limiter is not None:
            await self.rate_limiter.aclose()
        if self.redis is not None:
            await close(self.redis)


def build_auth(settings: Settings, clients_file: Path | None = None) -> AuthParts:
    """Replay store and rate limiter in Redis when ``CRYPTD_REDIS_URL`` is set; else both in
    ``CRYPTD_REPLAY_DIR`` (shared by the host's workers) or, without one, in memory (one
    process). ``clients_file`` overrides
    ``settings.clients_file`` (the development setup writes its own)."""
    path = clients_file or settings.clients_file
    if path is None:
        raise ValueError("CRYPTD_CLIENTS_FILE is not set")
    redis = connect(settings.redis_url) if settings.redis_url else None
    return AuthParts(
        ClientsFile(path), replay_store(settings, redis), _limiter(settings, redis), redis
    )


def replay_store(settings: Settings, redis: Redis | None) -> ReplayStore:
    skew = settings.signature_max_skew
    if redis is not None:
        return RedisReplayStore(redis, max_skew=skew)
    if settings.replay_dir is not None:
        return HostReplayStore(
            settings.replay_dir,
            max_age=settings.signature_max_age,
            max_skew=skew,
            max_bytes=settings.replay_max_bytes,
        )
    return MemoryReplayStore()


def _limiter(settings: Settings, redis: Redis | None) -> RateLimiter | None:
    if settings.rate_limit_per_second <= 0:
        return None
    rate, burst = settings.rate_limit_per_second, settings.rate_limit_burst
    if redis is not None:
        return RedisRateLimiter(redis, rate, burst)
    if settings.replay_dir is not None:  # every worker of the host shares the buckets
        return HostRateLimiter(settings.replay_dir, rate, burst)
    return MemoryRateLimiter(rate, burst)
