"""Replay stores: memory semantics and bounds, Redis shared by processes, Redis outages."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
import redis

from service.auth.coalesce import Coalescer
from service.auth.redis_client import close, connect
from service.auth.replay import KEY_PREFIX, MemoryReplayStore, RedisReplayStore, StoreUnavailable
from service.auth.signature import sign_request
from tests.test_auth_support import (
    SHARED_REDIS_URL,
    RedisServer,
    Server,
    make_app,
    require_redis,
    server_process,
    standard_clients,
)


def test_memory_store_first_time_then_replay() -> None:
    store = MemoryReplayStore()
    assert store.remember_now("a", "n1", 10, now=100.0)
    assert not store.remember_now("a", "n1", 10, now=105.0)
    assert store.remember_now("b", "n1", 10, now=105.0)  # pairs, not nonces alone
    assert not store.remember_now("a", "n1", 10, now=109.9)
    assert store.remember_now("a", "n1", 10, now=110.0)  # expired: a new request may reuse it


def test_memory_store_purges_expired_entries() -> None:
    store = MemoryReplayStore()
    for i in range(1000):
        store.remember_now("a", f"n{i}", 5 + i % 7, now=0.0)
    assert len(store) == 1000
    store.remember_now("a", "late", 5, now=8.0)
    assert len(store) == 1 + sum(1 for i in range(1000) if 5 + i % 7 > 8)
    store.remember_now("a", "later", 5, now=100.0)
    assert len(store) == 1


def test_memory_store_refuses_when_full_instead_of_forgetting() -> None:
    store = MemoryReplayStore(max_entries=3)
    for nonce in ("1", "2", "3"):
        assert store.remember_now("a", nonce, 60, now=0.0)
    with pytest.raises(StoreUnavailable):
        store.remember_now("a", "4", 60, now=1.0)
    assert not store.remember_now("a", "1", 60, now=1.0)  # still remembered
    assert store.remember_now("a", "4", 60, now=61.0)  # room again once they expire


async def test_redis_store_is_atomic_and_expires() -> None:
    require_redis()
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client)
    try:
        nonce = uuid.uuid4().hex
        assert await store.remember("app", nonce, 5)
        assert not await store.remember("app", nonce, 5)
        assert await store.remember("other", nonce, 5)
        ttl = await client.ttl(f"{KEY_PREFIX}app:{nonce}")
        assert 0 < ttl <= 5
        assert await store.ping()
    finally:
        await store.aclose()
        await close(client)


async def test_concurrent_requests_share_one_script_call() -> None:
    require_redis()
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client)
    try:
        nonces = [uuid.uuid4().hex for _ in range(300)]
        # Every nonce twice, the copies interleaved: exactly one of each pair is first.
        results = await asyncio.gather(*(store.remember("app", n, 5) for n in nonces + nonces))
        assert results == [True] * 300 + [False] * 300
        assert store._coalescer.batches <= 10  # 600 nonces, a handful of round trips
        # A lone request is not held back waiting for company.
        assert await store.remember("app", uuid.uuid4().hex, 5)
        # After SCRIPT FLUSH (as after a Redis restart) the script is sent again.
        await client.script_flush()
        assert await store.remember("app", uuid.uuid4().hex, 5)
    finally:
        await store.aclose()
        await close(client)


async def test_coalescer_batches_keeps_order_and_shares_failures() -> None:
    seen: list[list[int]] = []

    async def double(items: Sequence[int]) -> list[int]:
        seen.append(list(items))
        await asyncio.sleep(0.01)
        if -1 in items:
            raise OSError("boom")
        return [2 * i for i in items]

    coalescer: Coalescer[int, int] = Coalescer(double, max_batch=50, max_inflight=2)
    assert await asyncio.gather(*(coalescer.submit(i) for i in range(120))) == [
        2 * i for i in range(120)
    ]
    assert [len(batch) for batch in seen] == [50, 50, 20]
    results = await asyncio.gather(
        coalescer.submit(1), coalescer.submit(-1), return_exceptions=True
    )
    assert [type(r) for r in results] == [OSError, OSError]  # one batch, one fate
    assert await coalescer.submit(3) == 6  # and the next batch is fine


async def test_unreachable_redis_fails_fast() -> None:
    client = connect("redis://127.0.0.1:1/0")
    store = RedisReplayStore(client)
    with pytest.raises(StoreUnavailable):
        await store.remember("app", "n", 5)
    assert not await store.ping()
    await store.aclose()
    await close(client)


def _sign_get(secret: str) -> dict[str, str]:
    return sign_request("GET", "/v1/keys", "", b"", "app", base64.b64decode(secret))


@pytest.mark.slow
def test_replay_refused_across_two_server_processes(tmp_path: Path) -> None:
    require_redis()
    clients_file = tmp_path / "clients.json"
    secrets = standard_clients(clients_file)
    env = {"CRYPTD_TEST_CLIENTS_FILE": str(clients_file), "CRYPTD_TEST_REDIS_URL": SHARED_REDIS_URL}
    with server_process(env) as first, server_process(env) as second:
        headers = _sign_get(secrets["app"])
        assert httpx.get(first + "/v1/keys", headers=headers).status_code == 200
        replayed = httpx.get(second + "/v1/keys", headers=headers)
        assert replayed.status_code == 401
        assert replayed.json()["error"]["code"] == "unauthenticated"
        fresh = _sign_get(secrets["app"])
        assert httpx.get(second + "/v1/keys", headers=fresh).status_code == 200
        assert httpx.get(first + "/v1/keys", headers=fresh).status_code == 401


@pytest.mark.slow
def test_redis_outage_answers_503_and_recovers_by_itself(tmp_path: Path) -> None:
    clients_file = tmp_path / "clients.json"
    secrets = standard_clients(clients_file)
    rejections: list[str] = []
    with RedisServer() as private_redis:
        client = connect(private_redis.url)
        app = make_app(
            clients_file,
            replay=RedisReplayStore(client),
            rejections=rejections,
            redis_client=client,
        )
        with Server(app) as srv, httpx.Client(base_url=srv.url) as http:
            assert http.get("/v1/keys", headers=_sign_get(secrets["app"])).status_code == 200

            private_redis.stop()
            for _ in range(3):
                started = time.perf_counter()
                response = http.get("/v1/keys", headers=_sign_get(secrets["app"]))
                elapsed = time.perf_counter() - started
                assert response.status_code == 503
                assert response.json() == {
                    "error": {"code": "overloaded", "message": "replay store unavailable"}
                }
                assert response.headers["retry-after"] == "1"
            print(f"\nrequest while Redis is down: {elapsed * 1000:.1f} ms")

            private_redis.start()  # same port, empty: no restart of our server
            headers = _sign_get(secrets["app"])
            assert http.get("/v1/keys", headers=headers).status_code == 200
            assert http.get("/v1/keys", headers=headers).status_code == 401  # replay again caught
    assert rejections == ["replay_unavailable"] * 3


@pytest.mark.slow
def test_fail_open_accepts_during_an_outage_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cryptd.auth")
    clients_file = tmp_path / "clients.json"
    secrets = standard_clients(clients_file)
    with RedisServer() as private_redis:
        client = connect(private_redis.url)
        app = make_app(
            clients_file, replay=RedisReplayStore(client), fail_open=True, redis_client=client
        )
        with Server(app) as srv, httpx.Client(base_url=srv.url) as http:
            private_redis.stop()
            for _ in range(4):
                response = http.get("/v1/keys", headers=_sign_get(secrets["app"]))
                assert response.status_code == 200
            headers = _sign_get(secrets["app"])
            # Without a store, bad signatures are still refused...
            bad = dict(headers, Signature="sig1=:" + base64.b64encode(bytes(32)).decode() + ":")
            assert http.get("/v1/keys", headers=bad).status_code == 401
            outage = [r for r in caplog.records if "replay store unavailable" in r.getMessage()]
            assert len(outage) == 1
            assert "fail-open" in outage[0].getMessage()

            private_redis.start()
            assert http.get("/v1/keys", headers=headers).status_code == 200
            assert http.get("/v1/keys", headers=headers).status_code == 401
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_shared_redis_is_left_running() -> None:
    # The outage tests use their own redis-server; the shared one must still answer.
    require_redis()
    with redis.Redis.from_url(SHARED_REDIS_URL) as client:
        assert client.ping()
