"""The replay store on Redis Sentinel, with real servers: a failover is followed without a
restart, nonces the failover lost never reopen a replay, losing the replica alone only
degrades, and a master name no Sentinel knows is refused at start."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import exceptions as redis_exceptions
from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool

from service.auth.ratelimit import KEY_PREFIX as RATE_PREFIX
from service.auth.ratelimit import RedisRateLimiter
from service.auth.redis_client import RedisConfigError, check_target, close, connect, parse_url
from service.auth.replay import KEY_PREFIX, RedisReplayStore, StoreRecovering, StoreUnavailable
from service.auth.signature import sign_request
from service.errors import RateLimited
from tests.conftest import free_port, start_server, stop_server
from tests.test_redis_support import SentinelSetup, client, sentinel_setup, wait_until

pytestmark = pytest.mark.slow


async def _remember(store: RedisReplayStore, nonce: str, created: int) -> bool:
    """The store's verdict once it answers again (a failover costs a few refused attempts)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return await store.remember("app", nonce, created, 120)
        except StoreRecovering:
            raise
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _failover(ha: SentinelSetup) -> None:
    """SIGKILL the primary; return once the Sentinels have promoted the replica."""
    ha.primary.kill()
    wait_until(
        "the Sentinels to promote the replica",
        lambda: (
            ha.master_port() == ha.replica.port
            and client(ha.replica.port).info("replication")["role"] == "master"
        ),
        30,
    )


async def test_failover_loses_nonces_yet_accepts_no_replay(tmp_path: Path) -> None:
    with sentinel_setup(tmp_path) as ha:
        # A master name no Sentinel knows: refused at start, with the name.
        unknown = ha.url.replace("/cryptd-primary/", "/no-such-master/")
        wrong = connect(unknown)
        with pytest.raises(RedisConfigError, match="no-such-master"):
            await check_target(wrong, parse_url(unknown))
        wrong_store = RedisReplayStore(wrong)
        assert "MasterNotFoundError" in str((await wrong_store.health()).reason)
        await wrong_store.aclose()
        await close(wrong)

        redis = connect(ha.url)
        await check_target(redis, parse_url(ha.url))
        store = RedisReplayStore(redis, max_skew=1)
        limiter = RedisRateLimiter(redis, rate=0.2, burst=1)
        primary, replica = client(ha.primary.port), client(ha.replica.port)
        try:
            # The epoch is set before any request; readiness names the window, then clears.
            health = await store.establish()
            assert not health.ok
            assert "epoch" in str(health.reason)
            assert health.retry_after is not None
            await asyncio.sleep(health.retry_after)
            health = await store.health()
            assert health.ok
            assert health.degraded is None

            # Losing the replica alone: still serving, readiness says degraded.
            ha.replica.kill()
            wait_until("the primary to drop its replica", lambda: not _replicas(ha.primary.port))
            assert await store.remember("app", "while-alone", int(time.time()), 120)
            health = await store.health()
            assert health.ok
            assert "no replica" in str(health.degraded)
            ha.replica.start()
            ha.wait_replica_synced(ha.primary.port)
            assert (await store.health()).degraded is None

            kept_created = int(time.time())
            assert await store.remember("app", "kept", kept_created, 120)
            wait_until("the replica to hold the nonce", lambda: bool(replica.exists(_key("kept"))))
            # Cut the replica's link, then accept a nonce only the primary holds.
            replica.replicaof("127.0.0.1", free_port())
            wait_until(
                "the link to drop",
                lambda: replica.info("replication")["master_link_status"] == "down",
            )
            lost_created = int(time.time())
            assert await store.remember("app", "lost", lost_created, 120)
            assert primary.exists(_key("lost"))
            epoch_before = int(replica.get(f"{KEY_PREFIX}epoch") or 0)

            _failover(ha)
            # The new primary kept the epoch key and the first nonce, and lost the last one:
            # the epoch's presence proves nothing; the new identity starts a new epoch.
            assert not replica.exists(_key("lost"))
            assert replica.exists(f"{KEY_PREFIX}epoch")
            with pytest.raises(StoreRecovering):
                await _remember(store, "lost", lost_created)
            with pytest.raises(StoreRecovering):
                await _remember(store, "kept", kept_created)
            assert int(replica.get(f"{KEY_PREFIX}epoch") or 0) > epoch_before
            assert not replica.exists(_key("lost"))  # nothing stored for a refused request

            health = await store.health()
            assert not health.ok
            await asyncio.sleep(health.retry_after or 1)
            health = await store.health()
            assert health.ok
            assert "no replica" in str(health.degraded)  # the old primary is gone
            # The rate limiter follows the failover too (its buckets now on the new primary).
            await limiter.acquire("after")
            assert replica.exists(f"{RATE_PREFIX}after")
            with pytest.raises(RateLimited):
                await limiter.acquire("after")
            fresh = int(time.time())
            assert await store.remember("app", "fresh", fresh, 120)
            assert not await store.remember("app", "fresh", fresh, 120)
            with pytest.raises(StoreRecovering):  # still refused, however late it comes
                await store.remember("app", "lost", lost_created, 120)
        finally:
            await limiter.aclose()
            await store.aclose()
            await close(redis)


def _key(nonce: str) -> str:
    return f"{KEY_PREFIX}app:{nonce}"


def _replicas(port: int) -> int:
    return int(client(port).info("replication")["connected_slaves"])


def test_server_follows_a_failover_and_refuses_what_was_signed_before(tmp_path: Path) -> None:
    """``cryptd serve`` (two workers) on the Sentinel URL: ready only once the epoch's window
    has passed; after the primary is killed, no request signed before the failover is
    accepted again, /readyz names the new window, and fresh requests pass once it is over,
    with no restart."""
    with sentinel_setup(tmp_path / "redis") as ha:
        server = start_server(
            tmp_path / "srv",
            {"CRYPTD_REDIS_URL": ha.url, "CRYPTD_SIGNATURE_MAX_SKEW": "2"},
            workers=2,
        )
        try:
            with httpx.Client(base_url=server.url, timeout=10) as http:
                _wait_ready(http)
                accepted = []
                for _ in range(20):
                    headers = _signed(server.secret)
                    assert http.get("/v1/keys", headers=headers).status_code == 200
                    accepted.append(headers)
                _failover(ha)
                statuses = {http.get("/v1/keys", headers=h).status_code for h in accepted}
                assert statuses <= {401, 503}, statuses
                ready = _readyz_until_window(http)
                assert ready.status_code == 503
                assert ready.headers["retry-after"].isdigit()
                body = ready.json()
                assert body["status"] == "not_ready"
                assert any("replay store" in reason for reason in body["reasons"])
                _wait_ready(http)
                body = http.get("/readyz").json()
                assert body["status"] == "degraded"  # the new primary has no replica
                assert any("no replica" in reason for reason in body["reasons"])
                fresh = _signed(server.secret)
                assert http.get("/v1/keys", headers=fresh).status_code == 200
                assert http.get("/v1/keys", headers=fresh).status_code == 401
                for headers in accepted:  # after the window too: signed before the epoch
                    assert http.get("/v1/keys", headers=headers).status_code == 503
        finally:
            stop_server(server)


def _signed(secret: bytes) -> dict[str, str]:
    return sign_request("GET", "/v1/keys", "", b"", "dev", secret)


def _readyz_until_window(http: httpx.Client) -> httpx.Response:
    """The first /readyz answer after the failover that is not about an unreachable Redis."""
    deadline = time.monotonic() + 20
    while True:
        response = http.get("/readyz")
        reasons = " ".join(response.json().get("reasons", []))
        if "epoch" in reasons or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def _wait_ready(http: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while http.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, http.get("/readyz").text
        time.sleep(0.2)


async def test_a_sentinel_reply_received_while_the_event_loop_stalled_is_read(
    tmp_path: Path,
) -> None:
    """Finding the primary (every new connection asks the Sentinels) reads a Sentinel's reply
    that came in while the event loop stalled past the 250 ms read timeout, instead of counting
    that Sentinel as unreachable; a Sentinel that does not answer still times out."""
    with sentinel_setup(tmp_path) as ha:
        redis = connect(ha.url)
        pool = redis.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        sentinels = pool.sentinel_manager.sentinels
        master_address: Any = pool.get_master_address  # untyped in redis-py
        loop = asyncio.get_running_loop()
        primary = ("127.0.0.1", ha.primary.port)
        try:
            assert await master_address() == primary
            asked = sentinels[0]  # the Sentinel that answered is asked first from now on
            session = await asked.client_id()
            process = next(s for s in ha.sentinels if s.port == _port(asked)).process
            assert process is not None
            # The Sentinel answers after 50 ms (stopped until then); the loop stalls from 20 ms
            # to 420 ms, so the answer waits in the socket until the timer is due too.
            process.send_signal(signal.SIGSTOP)
            threading.Timer(0.05, process.send_signal, (signal.SIGCONT,)).start()
            loop.call_later(0.02, time.sleep, 0.4)
            assert await master_address() == primary
            # Read from that Sentinel, on the same connection: not timed out, dropped, and
            # asked of the next Sentinel.
            assert sentinels[0] is asked
            assert await asked.client_id() == session
            # A Sentinel that does not answer (stopped) still times out: after one period (two
            # if the timer ran late), or after a stall and one more period.
            process.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(redis_exceptions.TimeoutError):
                    await asked.ping()
                assert 0.24 < time.monotonic() - started < 0.9
                started = time.monotonic()
                loop.call_later(0.02, time.sleep, 0.4)
                with pytest.raises(redis_exceptions.TimeoutError):
                    await asked.ping()
                assert 0.6 < time.monotonic() - started < 1.5
                # The other Sentinels name the primary meanwhile.
                assert await master_address() == primary
            finally:
                process.send_signal(signal.SIGCONT)
        finally:
            await close(redis)


def _port(sentinel: Redis) -> int:
    return int(sentinel.connection_pool.connection_kwargs["port"])
