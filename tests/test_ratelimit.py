"""Token buckets in memory and in Redis; degradation when Redis is away; wiring from Settings."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from service.auth.ratelimit import MemoryRateLimiter, RedisRateLimiter, default_burst
from service.auth.redis_client import close, connect
from service.auth.replay import MemoryReplayStore, RedisReplayStore
from service.auth.setup import build_auth
from service.config import Settings
from service.errors import RateLimited
from tests.test_auth_support import SHARED_REDIS_URL, RedisServer, require_redis, standard_clients


def test_memory_bucket_allows_burst_then_rate() -> None:
    limiter = MemoryRateLimiter(rate=2, burst=3)
    for _ in range(3):
        limiter.acquire_now("a", now=10.0)
    with pytest.raises(RateLimited) as info:
        limiter.acquire_now("a", now=10.0)
    assert info.value.retry_after == pytest.approx(0.5)  # one token at 2/s
    assert info.value.code == "rate_limited"
    limiter.acquire_now("b", now=10.0)  # buckets are per client
    limiter.acquire_now("a", now=10.5)  # refilled one token
    with pytest.raises(RateLimited) as info:
        limiter.acquire_now("a", now=10.6)
    assert info.value.retry_after == pytest.approx(0.4)
    for _ in range(3):  # a long pause refills to the burst, never beyond
        limiter.acquire_now("a", now=1000.0)
    with pytest.raises(RateLimited):
        limiter.acquire_now("a", now=1000.0)


def test_burst_defaults_and_zero_rate() -> None:
    assert default_burst(0.5, 0) == 1
    assert default_burst(10, 0) == 10
    assert default_burst(10, 4) == 4
    with pytest.raises(ValueError, match="rate"):
        MemoryRateLimiter(rate=0)


def _settings(tmp_path: Path, **values: object) -> Settings:
    clients = tmp_path / "clients.json"
    standard_clients(clients)
    return Settings(env="development", clients_file=clients, **values)  # type: ignore[arg-type]


async def test_settings_wiring(tmp_path: Path) -> None:
    parts = build_auth(_settings(tmp_path, rate_limit_per_second=0, redis_url=None))
    assert parts.rate_limiter is None  # rate 0: disabled
    assert isinstance(parts.replay, MemoryReplayStore)
    assert parts.clients().get("app") is not None
    await parts.aclose()

    parts = build_auth(_settings(tmp_path, rate_limit_per_second=5, rate_limit_burst=7))
    assert isinstance(parts.rate_limiter, MemoryRateLimiter)
    assert parts.rate_limiter.burst == 7

    parts = build_auth(_settings(tmp_path, rate_limit_per_second=5, redis_url=SHARED_REDIS_URL))
    assert isinstance(parts.replay, RedisReplayStore)
    assert isinstance(parts.rate_limiter, RedisRateLimiter)
    await parts.aclose()


async def test_redis_bucket_is_shared_and_atomic() -> None:
    require_redis()
    prefix = f"cryptd:test:ratelimit:{uuid.uuid4().hex}:"
    first, second = connect(SHARED_REDIS_URL), connect(SHARED_REDIS_URL)
    # Two limiters (as in two replicas) share one bucket of 3.
    one = RedisRateLimiter(first, rate=1, burst=3, prefix=prefix)
    two = RedisRateLimiter(second, rate=1, burst=3, prefix=prefix)
    try:
        await one.acquire("app")
        await two.acquire("app")
        await one.acquire("app")
        with pytest.raises(RateLimited) as info:
            await two.acquire("app")
        assert 0 < info.value.retry_after <= 1.0
        await two.acquire("other-client")
        ttl = await first.pttl(prefix + "app")
        assert 0 < ttl <= 4000  # buckets expire once they would be full again
    finally:
        await one.aclose()
        await two.aclose()
        await close(first)
        await close(second)


@pytest.mark.slow
async def test_redis_outage_falls_back_to_local_buckets(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cryptd.auth")
    with RedisServer() as private_redis:
        client = connect(private_redis.url)
        limiter = RedisRateLimiter(client, rate=1, burst=2)
        try:
            await limiter.acquire("app")
            private_redis.stop()
            await limiter.acquire("app")  # local bucket: fresh, burst 2
            await limiter.acquire("app")
            with pytest.raises(RateLimited):
                await limiter.acquire("app")
            warnings = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
            assert len(warnings) == 1
            private_redis.start()
            await limiter.acquire("app")  # Redis again: a new, full bucket there
            assert any("reachable again" in r.getMessage() for r in caplog.records)
        finally:
            await limiter.aclose()
            await close(client)
