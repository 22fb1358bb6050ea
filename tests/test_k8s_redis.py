"""The Redis the manifests deploy, run for real: k8s/redis/redis.conf with the ACL that
k8s/scripts/make-secrets.sh builds, driven by cryptd's own replay store and rate limiter
through the URL from the same Secret. Proves that cryptd gets what it needs and nothing more."""

from __future__ import annotations

import base64
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.exceptions
from redis.asyncio import Redis

from service.auth import redis_client
from service.auth.ratelimit import RedisRateLimiter
from service.auth.replay import RedisReplayStore, StoreRecovering
from service.errors import RateLimited
from tests.test_k8s_support import make_secrets, redis_from_manifests, world_tempdir

Secrets = dict[str, dict[str, bytes]]


@pytest.fixture(scope="module")
def secrets_and_port() -> Iterator[tuple[Secrets, int]]:
    with world_tempdir() as work:
        (work / "master.key").write_text(base64.b64encode(os.urandom(32)).decode())
        (work / "keyring.json").write_text('{"keys": {}}')
        (work / "clients.json").write_text('{"clients": {}}')
        secrets = make_secrets(
            work,
            work / "master.key",
            work / "keyring.json",
            work / "clients.json",
            work / "redis-password",
        )
        with redis_from_manifests(work, secrets["cryptd-redis"]["users.acl"]) as port:
            yield secrets, port


def local_url(secrets: Secrets, port: int, password: str | None = None) -> str:
    """The Secret's URL, pointed at the local server instead of the cryptd-redis Service."""
    parts = urlsplit(secrets["cryptd-redis"]["url"].decode())
    assert parts.hostname == "cryptd-redis"
    assert parts.port == 6379
    assert parts.username == "cryptd"
    user_info = f"cryptd:{password if password is not None else parts.password}"
    return urlunsplit(parts._replace(netloc=f"{user_info}@127.0.0.1:{port}"))


@contextlib.asynccontextmanager
async def cryptd_client(secrets_and_port: tuple[Secrets, int]) -> AsyncIterator[Redis]:
    """A client made the way cryptd makes it, from the URL in the Secret."""
    secrets, port = secrets_and_port
    connection = redis_client.connect(local_url(secrets, port))
    try:
        yield connection
    finally:
        await redis_client.close(connection)


async def test_replay_store_works_with_the_acl(secrets_and_port: tuple[Secrets, int]) -> None:
    async with cryptd_client(secrets_and_port) as client:
        store = RedisReplayStore(client)
        nonce = base64.urlsafe_b64encode(os.urandom(12)).decode()
        # A Redis that has never seen cryptd: the script (INFO, TIME, GET, SET under the ACL)
        # sets the epoch, and readiness names the window in which it refuses what was signed
        # before it plus the skew.
        health = await store.health()
        assert not health.ok
        assert health.reason is not None
        assert "epoch" in health.reason, health.reason
        now = int(time.time())
        with pytest.raises(StoreRecovering):
            await store.remember("client-a", nonce, now, 300)
        later = now + 10
        assert await store.remember("client-a", nonce, later, 300) is True
        assert await store.remember("client-a", nonce, later, 300) is False  # replay refused
        assert await store.remember("client-b", nonce, later, 300) is True
        await store.aclose()


async def test_rate_limiter_script_works_with_the_acl(
    secrets_and_port: tuple[Secrets, int],
) -> None:
    async with cryptd_client(secrets_and_port) as client:
        limiter = RedisRateLimiter(client, rate=0.5, burst=1)
        client_id = f"client-{os.urandom(4).hex()}"
        await limiter.acquire(client_id)
        with pytest.raises(RateLimited):
            await limiter.acquire(client_id)
        await limiter.aclose()


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("CONFIG", "GET", "maxmemory"),
        ("KEYS", "*"),
        ("INFO",),
        ("ACL", "LIST"),
        ("SHUTDOWN",),
        ("MONITOR",),
        ("SET", "other:key", "1"),
    ],
)
async def test_anything_else_is_refused(
    secrets_and_port: tuple[Secrets, int], command: tuple[str, ...]
) -> None:
    async with cryptd_client(secrets_and_port) as client:
        untyped: Any = client
        with pytest.raises(redis.exceptions.NoPermissionError):
            await untyped.execute_command(*command)


async def test_debug_is_disabled_altogether(secrets_and_port: tuple[Secrets, int]) -> None:
    async with cryptd_client(secrets_and_port) as client:
        untyped: Any = client
        with pytest.raises(redis.exceptions.ResponseError, match="DEBUG command not allowed"):
            await untyped.execute_command("DEBUG", "SLEEP", "0")


async def test_unauthenticated_and_wrong_password_are_refused(
    secrets_and_port: tuple[Secrets, int],
) -> None:
    _, port = secrets_and_port
    secrets, _ = secrets_and_port
    for url in (f"redis://127.0.0.1:{port}/0", local_url(secrets, port, password="wrong")):
        connection = redis_client.connect(url)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                await connection.ping()
        finally:
            await redis_client.close(connection)


def test_the_secret_holds_only_a_hash_for_redis(secrets_and_port: tuple[Secrets, int]) -> None:
    import hashlib

    secrets, _ = secrets_and_port
    acl = secrets["cryptd-redis"]["users.acl"].decode()
    password = urlsplit(secrets["cryptd-redis"]["url"].decode()).password
    assert password is not None
    assert len(password) >= 32
    assert password not in acl
    assert f"#{hashlib.sha256(password.encode()).hexdigest()} " in acl
    assert "user default off" in acl


def test_config_keeps_nothing_and_never_evicts() -> None:
    conf = Path(__file__).resolve().parent.parent / "k8s" / "redis" / "redis.conf"
    settings = {
        line.split(None, 1)[0]: line.split(None, 1)[1]
        for line in conf.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert settings["save"] == '""'
    assert settings["appendonly"] == "no"
    assert settings["maxmemory-policy"] == "noeviction"
    assert settings["protected-mode"] == "yes"
