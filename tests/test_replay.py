"""Replay stores: memory semantics and bounds, Redis shared by processes, Redis outages and
restarts (the epoch)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service.auth.authenticator import Authenticator
from service.auth.clients import ClientsFile
from service.auth.coalesce import Coalescer
from service.auth.redis_client import SerialConnection, close, connect
from service.auth.replay import (
    KEY_PREFIX,
    SEED_SCRIPT,
    MemoryReplayStore,
    RedisReplayStore,
    StoreRecovering,
    StoreUnavailable,
    TooOld,
)
from service.auth.signature import AuthError, sign_request
from tests.conftest import start_server, stop_server
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


def _now() -> int:
    return int(time.time())


async def _fresh_prefix(client: Redis) -> str:
    """A key prefix of its own on the shared Redis, with epoch 0 (nothing was lost), expiring."""
    prefix = f"test:{uuid.uuid4().hex}:"
    await client.eval(SEED_SCRIPT, 2, f"{prefix}epoch", f"{prefix}primary", "0")
    for key in ("epoch", "primary"):
        await client.expire(f"{prefix}{key}", 600)
    return prefix


async def test_redis_store_is_atomic_and_expires() -> None:
    require_redis()
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client, prefix=await _fresh_prefix(client))
    try:
        nonce = uuid.uuid4().hex
        assert await store.remember("app", nonce, _now(), 5)
        assert not await store.remember("app", nonce, _now(), 5)
        assert await store.remember("other", nonce, _now(), 5)
        # Kept until Redis's own clock would refuse the request (max age 300 s), however
        # short a TTL the replica asked for.
        ttl = await client.ttl(f"{store._prefix}app:{nonce}")
        assert 295 < ttl <= 301
        assert await store.ping()
    finally:
        await store.aclose()
        await close(client)


async def test_replicas_whose_clocks_disagree_accept_no_replay() -> None:
    """The nonce's life and the age check run on Redis's clock: a replica 10 s ahead asks
    for a TTL 10 s too short, and a replica 10 s behind would accept a request for 10 s after
    the others refuse it; neither lets a replay through."""
    require_redis()
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client, prefix=await _fresh_prefix(client), max_age=20)
    try:
        redis_now = int((await client.time())[0])
        # Accepted by a replica whose clock is 10 s ahead: it asks for created + 20 - (now + 10).
        nonce = uuid.uuid4().hex
        assert await store.remember("app", nonce, redis_now, 20 - 10)
        ttl = await client.ttl(f"{store._prefix}app:{nonce}")
        assert ttl > 20 - 10  # kept as long as Redis's clock lets the request pass
        # A request 25 s old by Redis's clock, that a replica 10 s behind still finds young
        # enough (15 s < 20 s): refused as stale, never stored.
        old = uuid.uuid4().hex
        with pytest.raises(TooOld):
            await store.remember("app", old, redis_now - 25, 1)
        assert await client.exists(f"{store._prefix}app:{old}") == 0
    finally:
        await store.aclose()
        await close(client)


async def test_concurrent_requests_share_one_script_call() -> None:
    require_redis()
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client, prefix=await _fresh_prefix(client))
    try:
        nonces = [uuid.uuid4().hex for _ in range(300)]
        # Every nonce twice, the copies interleaved: exactly one of each pair is first.
        now = _now()
        results = await asyncio.gather(*(store.remember("app", n, now, 5) for n in nonces + nonces))
        assert results == [True] * 300 + [False] * 300
        assert store._coalescer.batches <= 10  # 600 nonces, a handful of round trips
        # A lone request is not held back waiting for company.
        assert await store.remember("app", uuid.uuid4().hex, _now(), 5)
        # After SCRIPT FLUSH (as after a Redis restart) the script is sent again.
        await client.script_flush()
        assert await store.remember("app", uuid.uuid4().hex, _now(), 5)
    finally:
        await store.aclose()
        await close(client)


async def test_redis_epoch_is_set_once_and_refuses_what_was_signed_before_it() -> None:
    """A Redis that has lost its nonces (restart, flush) has no epoch: the first script call
    sets one, atomically with its own nonces, and requests created before epoch + skew are
    refused with how long to wait; nothing of theirs is stored."""
    require_redis()
    client = connect(SHARED_REDIS_URL)
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisReplayStore(client, prefix=prefix, max_skew=5)
    try:
        before = _now()
        with pytest.raises(StoreRecovering) as refused:
            await store.remember("app", "n1", before, 300)
        epoch = int(cast(bytes, await client.get(f"{prefix}epoch")))
        assert before < epoch <= before + 2  # Redis's clock, rounded up
        assert refused.value.retry_after == epoch + 5 - before
        assert await client.exists(f"{prefix}app:n1") == 0
        for key in ("epoch", "primary"):  # the test's keys go away by themselves
            await client.expire(f"{prefix}{key}", 600)
        # In one batch: the early one refused, the late one stored, the late one's copy a replay.
        results = list(
            await asyncio.gather(
                store.remember("app", "n2", epoch + 4, 300),
                store.remember("app", "n3", epoch + 5, 300),
                store.remember("app", "n3", epoch + 5, 300),
                return_exceptions=True,
            )
        )
        assert isinstance(results[0], StoreRecovering)
        assert results[0].retry_after == 1
        assert results[1:] == [True, False]
        # The epoch is never moved by later calls.
        assert int(cast(bytes, await client.get(f"{prefix}epoch"))) == epoch
    finally:
        await client.delete(f"{prefix}app:n3")
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


async def test_a_reply_received_while_the_event_loop_stalled_is_not_a_timeout() -> None:
    """The event loop held up past the 250 ms read timeout (another request's long synchronous
    step) while Redis answers: the answer is in the socket when the loop runs again, together
    with the timer. It is read, not refused as "replay store unavailable"; a Redis that does
    not answer still ends in a timeout, at most one period more for the stall."""
    require_redis()
    client = connect(SHARED_REDIS_URL, socket_timeout=0.25)
    connection = SerialConnection(client)
    loop = asyncio.get_running_loop()
    nothing = f"cryptd-test:stall:{uuid.uuid4().hex}"
    try:
        assert await connection.pipeline([("PING",)]) == [b"PONG"]
        # Redis answers after 50 ms (BLPOP's own timeout: nil); the loop stalls from 20 ms
        # to 420 ms, so the answer waits in the socket until both are due.
        loop.call_later(0.02, time.sleep, 0.4)
        assert await connection.pipeline([("BLPOP", nothing, "0.05")]) == [None]
        # Redis silent for 2 s: a timeout after 250 ms when nothing stalls...
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await connection.pipeline([("BLPOP", nothing, "2")])
        # (a loaded machine may run the timer late and extend it once: 0.5 s)
        assert 0.24 < time.monotonic() - started < 0.9
        # ... and one more period after the stall ended when one did.
        started = time.monotonic()
        loop.call_later(0.02, time.sleep, 0.4)
        with pytest.raises(redis.exceptions.TimeoutError):
            await connection.pipeline([("BLPOP", nothing, "2")])
        assert 0.6 < time.monotonic() - started < 1.5
        # The connection was dropped with the unread reply; the next batch reconnects.
        assert await connection.pipeline([("PING",)]) == [b"PONG"]
    finally:
        await connection.aclose()
        await close(client)


async def test_the_pooled_client_reads_a_reply_received_while_the_event_loop_stalled() -> None:
    """The pooled client (redis-py's own command path: pings, start-up checks) keeps the
    guarantee of the batch connection above: a reply received during a loop stall is read,
    a silent Redis still times out."""
    require_redis()
    client = connect(SHARED_REDIS_URL, socket_timeout=0.25)
    execute: Any = client.execute_command  # untyped in redis-py
    loop = asyncio.get_running_loop()
    nothing = f"cryptd-test:stall:{uuid.uuid4().hex}"
    try:
        assert await client.ping()
        session = await client.client_id()
        loop.call_later(0.02, time.sleep, 0.4)  # as above: the reply waits in the socket
        assert await execute("BLPOP", nothing, "0.05") is None
        # Read on the same connection: not timed out, dropped and sent again (the client's
        # one retry would hide the lost reply, at the cost of running the command twice).
        assert await client.client_id() == session
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await execute("BLPOP", nothing, "2")
        assert 0.24 < time.monotonic() - started < 0.9  # one period (two if the timer ran late)
        started = time.monotonic()
        loop.call_later(0.02, time.sleep, 0.4)
        with pytest.raises(redis.exceptions.TimeoutError):
            await execute("BLPOP", nothing, "2")
        assert 0.6 < time.monotonic() - started < 1.5  # the stall, then one more period
        assert await client.ping()
    finally:
        await close(client)


async def test_a_connection_made_while_the_event_loop_stalled_is_not_a_timeout() -> None:
    """The connect itself (socket_connect_timeout, 250 ms): a connection Redis accepted while
    the loop stalled is used, not refused as "Timeout connecting"; a server that never
    accepts still times out, at most one period more for a stall."""
    require_redis()
    client = connect(SHARED_REDIS_URL, socket_timeout=0.25)
    loop = asyncio.get_running_loop()
    try:
        make: Any = client.connection_pool.make_connection  # untyped in redis-py
        connection = make()
        # The first attempt alone: the client's one retry would hide a refused connection at
        # the cost of connecting twice.
        connection.retry = Retry(NoBackoff(), 0)
        # The loop stalls in the pass after the connect starts (the kernel completes it
        # meanwhile), 400 ms: the socket is ready when the timer is due too.
        loop.call_soon(time.sleep, 0.4)
        await connection.connect()
        await connection.send_command("PING")
        assert await connection.read_response() == b"PONG"
        await connection.disconnect()
        with _no_accept() as port:
            silent = connect(f"redis://127.0.0.1:{port}/0", socket_timeout=0.25)
            make = silent.connection_pool.make_connection
            connection = make()
            connection.retry = Retry(NoBackoff(), 0)
            try:
                started = time.monotonic()
                with pytest.raises(redis.exceptions.TimeoutError):
                    await connection.connect()
                assert 0.24 < time.monotonic() - started < 0.9
                started = time.monotonic()
                loop.call_soon(time.sleep, 0.4)
                with pytest.raises(redis.exceptions.TimeoutError):
                    await connection.connect()
                assert 0.6 < time.monotonic() - started < 1.5
            finally:
                await close(silent)
    finally:
        await close(client)


@contextlib.contextmanager
def _no_accept() -> Iterator[int]:
    """A port whose connects hang: a listener that never accepts, its queue already full."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = int(listener.getsockname()[1])
        queued = []
        try:
            for _ in range(8):
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
                queued.append(sock)
            yield port
        finally:
            for sock in queued:
                sock.close()


async def test_unreachable_redis_fails_fast() -> None:
    client = connect("redis://127.0.0.1:1/0")
    store = RedisReplayStore(client)
    with pytest.raises(StoreUnavailable):
        await store.remember("app", "n", _now(), 5)
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


def _wait_out(response: httpx.Response) -> None:
    """A 503 from a restarted store says how long to wait; wait that long."""
    assert response.status_code == 503, response.text
    assert response.json() == {
        "error": {"code": "overloaded", "message": "replay store restarted: sign the request again"}
    }
    time.sleep(int(response.headers["retry-after"]))


@pytest.mark.slow
def test_redis_outage_answers_503_and_recovers_by_itself(tmp_path: Path) -> None:
    clients_file = tmp_path / "clients.json"
    secrets = standard_clients(clients_file)
    rejections: list[str] = []
    with RedisServer() as private_redis:
        client = connect(private_redis.url)
        app = make_app(
            clients_file,
            replay=RedisReplayStore(client, max_skew=1),
            max_skew=1,
            rejections=rejections,
            redis_client=client,
        )
        with Server(app) as srv, httpx.Client(base_url=srv.url) as http:
            accepted = _sign_get(secrets["app"])
            assert http.get("/v1/keys", headers=accepted).status_code == 200

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
            # The request accepted before the restart is not accepted again...
            assert http.get("/v1/keys", headers=accepted).status_code == 503
            # ...and a fresh one waits out the restart window (a second or two here).
            _wait_out(http.get("/v1/keys", headers=_sign_get(secrets["app"])))
            headers = _sign_get(secrets["app"])
            assert http.get("/v1/keys", headers=headers).status_code == 200
            assert http.get("/v1/keys", headers=headers).status_code == 401  # replay again caught
            assert http.get("/v1/keys", headers=accepted).status_code in (401, 503)
    assert rejections[:3] == ["replay_unavailable"] * 3
    assert set(rejections[3:]) == {"replay_recovering"}


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
            clients_file,
            replay=RedisReplayStore(client, max_skew=1),
            max_skew=1,
            fail_open=True,
            redis_client=client,
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
            # Fail-open covers an outage, not the restart window: what was signed before the
            # restart is refused even so.
            _wait_out(http.get("/v1/keys", headers=headers))
            headers = _sign_get(secrets["app"])
            assert http.get("/v1/keys", headers=headers).status_code == 200
            assert http.get("/v1/keys", headers=headers).status_code == 401
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    assert sum("replay store restarted" in r.getMessage() for r in caplog.records) == 1


@dataclass
class Outcome:
    at: float  # monotonic time the answer came
    status: int
    headers: dict[str, str]


def _load(server_url: str, secret: bytes, stop: threading.Event, out: list[Outcome]) -> None:
    """Fresh signed requests, one after another on one keep-alive connection, until stopped."""
    with httpx.Client(base_url=server_url, timeout=10) as http:
        while not stop.is_set():
            headers = sign_request("GET", "/v1/keys", "", b"", "dev", secret)
            try:
                status = http.get("/v1/keys", headers=headers).status_code
            except httpx.HTTPError:
                status = 0
            out.append(Outcome(time.monotonic(), status, headers))


@pytest.mark.slow
def test_redis_killed_and_restarted_under_load_accepts_no_replay(tmp_path: Path) -> None:
    """Two server workers on a private Redis under steady load; Redis is SIGKILLed and started
    again empty. Every request accepted before the kill is replayed, through fresh connections
    (so both workers get some), right after the restart and again once the window has passed:
    none is accepted. Fresh requests get 503 (Retry-After) for the restart window, then 200."""
    with RedisServer() as private_redis:
        server = start_server(tmp_path / "srv", {"CRYPTD_REDIS_URL": private_redis.url}, workers=2)
        stop = threading.Event()
        outcomes: list[list[Outcome]] = [[] for _ in range(6)]
        threads = [
            threading.Thread(target=_load, args=(server.url, server.secret, stop, out))
            for out in outcomes
        ]
        try:
            for thread in threads:
                thread.start()
            time.sleep(3)
            killed = time.monotonic()
            private_redis.kill()
            time.sleep(1)
            private_redis.start()
            restarted = time.monotonic()
            # The latest 200 accepted before the kill, in acceptance order.
            accepted_before = sorted(
                (o for out in outcomes for o in out if o.status == 200 and o.at < killed),
                key=lambda o: o.at,
            )[-200:]
            # A new connection for every replay: the kernel spreads them over the workers.
            fresh_connections = httpx.Limits(max_keepalive_connections=0)

            def replay_all() -> list[int]:
                with httpx.Client(
                    base_url=server.url, limits=fresh_connections, timeout=10
                ) as http:
                    return [
                        http.get("/v1/keys", headers=o.headers).status_code for o in accepted_before
                    ]

            at_once = replay_all()
            time.sleep(8)  # past the restart window (skew 5 s + rounding)
            later = replay_all()
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            stop_server(server)
    assert len(accepted_before) >= 64
    assert 200 not in at_once, "a request accepted before the restart was accepted again"
    assert 200 not in later, "a request accepted before the restart was accepted again"
    assert set(at_once) <= {401, 503}
    assert set(later) <= {401, 503}
    after = sorted((o for out in outcomes for o in out if o.at > restarted), key=lambda o: o.at)
    first_ok = next(o.at for o in after if o.status == 200)
    refused = [o for o in after if o.at < first_ok]
    assert {o.status for o in refused} <= {503}
    assert first_ok - restarted < 5 + 3  # the skew, rounding and a loaded machine
    settled = [o.status for o in after if o.at > first_ok + 1]
    assert settled
    assert set(settled) == {200}
    print(
        f"\n{len(accepted_before)} accepted before the kill, replayed twice: "
        f"{sorted(set(at_once))} / {sorted(set(later))}; fresh requests after the restart: "
        f"{len(refused)} refused (503) for {first_ok - restarted:.1f} s, then "
        f"{len(settled)} accepted"
    )


def test_shared_redis_is_left_running() -> None:
    # The outage tests use their own redis-server; the shared one must still answer.
    require_redis()
    with redis.Redis.from_url(SHARED_REDIS_URL) as client:
        assert client.ping()


def _authenticator(clients: Path, store: RedisReplayStore, **options: Any) -> Authenticator:
    """An authenticator of ``clients`` on ``store``, failing closed, with no rate limit."""
    return Authenticator(
        registry_provider=ClientsFile(clients),
        replay=store,
        rate_limiter=None,
        fail_open=False,
        **options,
    )


async def test_a_replica_whose_clock_is_behind_refuses_what_redis_calls_too_old(
    tmp_path: Path,
) -> None:
    """The authenticator of a host 10 s behind Redis: a request 25 s old by Redis's clock
    passes its own age check (15 s < 20 s) and is refused 401 ``stale`` by the store."""
    require_redis()
    secrets = standard_clients(tmp_path / "clients.json")
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client, prefix=await _fresh_prefix(client), max_age=20)
    redis_now = int((await client.time())[0])
    behind = _authenticator(
        tmp_path / "clients.json", store, max_age=20, clock=lambda: float(redis_now - 10)
    )
    try:
        secret = base64.b64decode(secrets["app"])
        scope = {"method": "GET", "path": "/v1/keys", "query_string": b"", "state": {}}
        old = sign_request("GET", "/v1/keys", "", b"", "app", secret, created=redis_now - 25)
        with pytest.raises(AuthError) as refused:
            await behind.authenticate(scope, {k.lower(): v for k, v in old.items()}, b"")
        assert refused.value.reason == "stale"
        young = sign_request("GET", "/v1/keys", "", b"", "app", secret, created=redis_now - 12)
        client_seen = await behind.authenticate(
            dict(scope, state={}), {k.lower(): v for k, v in young.items()}, b""
        )
        assert client_seen.client_id == "app"
    finally:
        await store.aclose()
        await close(client)


async def test_an_unreachable_store_is_asked_again_without_traffic(tmp_path: Path) -> None:
    """Redis dies and comes back empty while no request arrives (every host out of the
    balancer): the authenticator reaches it by itself, so the new epoch, and with it the end
    of the refusal window, starts at once, not at the next request or health check. A request
    signed before the epoch plus the skew is still refused (503 recovering, never accepted)."""
    secrets = standard_clients(tmp_path / "clients.json")
    secret = base64.b64decode(secrets["app"])
    with RedisServer() as private_redis:
        client = connect(private_redis.url)
        store = RedisReplayStore(client)
        authenticator = _authenticator(tmp_path / "clients.json", store, max_age=300)
        scope = {"method": "GET", "path": "/v1/keys", "query_string": b"", "state": {}}

        async def send(created: int | None = None) -> None:
            signed = sign_request("GET", "/v1/keys", "", b"", "app", secret, created=created)
            headers = {k.lower(): v for k, v in signed.items()}
            await authenticator.authenticate(dict(scope, state={}), headers, b"")

        try:
            await send()
            private_redis.kill()
            before = _now()
            with pytest.raises(StoreUnavailable) as down:
                await send()
            assert not isinstance(down.value, StoreRecovering)
            private_redis.start()
            # No request from here on: the epoch must appear by itself.
            deadline = time.monotonic() + 5
            with redis.Redis.from_url(private_redis.url) as plain:
                while plain.get(f"{KEY_PREFIX}epoch") is None:
                    assert time.monotonic() < deadline, "nobody reached the restarted Redis"
                    await asyncio.sleep(0.02)
                epoch = int(plain.get(f"{KEY_PREFIX}epoch") or 0)
            assert epoch >= before
            with pytest.raises(StoreRecovering):
                await send(created=before)
        finally:
            await authenticator.aclose()
            await store.aclose()
            await close(client)
