"""This host's clock against its references, in /readyz (service/auth/clock.py,
service/api/clock_readiness.py): the real application on the real Redis (and, for the second
reference, the real PostgreSQL key store), its clock set 10 s behind, 10 s ahead or right; and
the decision on its own: not ready only when two references agree."""

from __future__ import annotations

import asyncio
import base64
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from service.api.application import create_app
from service.auth.clock import REFERENCE, ClockOffset, ClockVerdict, Reading, judge
from service.auth.redis_client import close, connect
from service.auth.replay import RedisReplayStore
from service.auth.signature import sign_request
from service.config import Settings
from service.keys.admin import create_keyring_file, initialise
from service.keys.filestore import FileKeyStore
from service.keys.masterkey import MasterKey
from service.keys.pgstore import CLOCK_REFERENCE, PostgresKeyStore
from service.keys.store import KeyStore
from tests.test_auth_support import SHARED_REDIS_URL, require_redis, standard_clients

# Generous: the offset is measured over a local round trip (well under a millisecond when the
# machine is quiet); a loaded CI machine may stretch it to tens of milliseconds.
TOLERANCE = 0.5
BEHIND_BOTH = re.compile(
    r"clock: this host's clock is (\d+\.\d) s behind Redis TIME and (\d+\.\d) s behind "
    r"PostgreSQL clock_timestamp\(\); correctly signed requests are refused as signed in the "
    r"future \(max skew 1 s\)"
)
BEHIND_ONE = re.compile(
    r"clock: this host's clock is (\d+\.\d) s behind Redis TIME; correctly signed requests "
    r"are refused as signed in the future \(max skew 1 s\); not taken out of service: only "
    r"one reference \(Redis TIME\), and one machine's clock must not take every host out"
)
AHEAD = re.compile(
    r"clock: this host's clock is (\d+\.\d) s ahead of Redis TIME; requests are still "
    r"accepted \(the replay store's clock bounds their age\), but expire here \d+\.\d s early "
    r"\(max skew 1 s, max age 300 s\)"
)


@asynccontextmanager
async def _service(
    tmp_path: Path,
    clock: Callable[[], float],
    *,
    redis: bool = True,
    keystore_url: str | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, bytes]]:
    """The whole application with ``clock``, on the shared Redis (or its memory store), its
    keyring in a file or in the PostgreSQL database ``keystore_url``, and the secret of its
    client ``app``."""
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    keyring = tmp_path / "keyring.json"
    if keystore_url is None:
        create_keyring_file(keyring, MasterKey(master))
    else:
        store = PostgresKeyStore(keystore_url)
        try:
            initialise(store, MasterKey(master))  # the schema, then an empty keyring
        finally:
            store.close()
    clients = tmp_path / "clients.json"
    secret = base64.b64decode(standard_clients(clients)["app"])
    settings = Settings(
        env="production",
        tls="off",  # called in-process: no socket, no TLS to terminate
        master_key_file=tmp_path / "master.key",
        keyring_file=keyring,
        keystore_url=None if keystore_url is None else SecretStr(keystore_url),
        clients_file=clients,
        audit_log="off",
        docs=False,
        redis_url=SHARED_REDIS_URL if redis else None,
        replay_dir=None,
        signature_max_skew=1,
        signature_max_age=300,
    )
    app = create_app(settings, clock=clock)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cryptd") as http:
            yield http, secret


async def _readyz(http: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
    """/readyz once the replay store itself is ready (the shared Redis's epoch is seeded by
    conftest; a Redis restarted meanwhile would refuse for its window first)."""
    deadline = time.monotonic() + 15
    while True:
        answer = await http.get("/readyz")
        body: dict[str, Any] = answer.json()
        if body["checks"]["replay_store"]["ok"] or time.monotonic() > deadline:
            return answer.status_code, body
        await asyncio.sleep(0.1)


async def _gauge(http: httpx.AsyncClient, store: str = "replay") -> float:
    text = (await http.get("/metrics")).text
    found = re.search(rf'^cryptd_clock_offset_seconds\{{store="{store}"\}} (\S+)$', text, re.M)
    assert found, text
    return float(found.group(1))


async def _with_keystore_reading(http: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
    """/readyz once the key store's server clock has been read (the lease's first
    announcement, made at start)."""
    deadline = time.monotonic() + 15
    while True:
        status, body = await _readyz(http)
        if len(body["checks"]["clock"].get("references", [])) == 2 or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.1)


async def test_a_host_clock_10_s_behind_both_references_is_not_ready(
    tmp_path: Path, pg_database: str
) -> None:
    """Redis TIME and the PostgreSQL key store's clock agree: this host is 10 s behind."""
    require_redis()
    async with _service(tmp_path, lambda: time.time() - 10, keystore_url=pg_database) as (
        http,
        secret,
    ):
        status, body = await _with_keystore_reading(http)
        assert status == 503, body
        assert body["status"] == "not_ready"
        assert len(body["reasons"]) == 1, body
        reason = BEHIND_BOTH.fullmatch(body["reasons"][0])
        assert reason, body["reasons"]
        assert abs(float(reason.group(1)) - 10) < TOLERANCE
        assert abs(float(reason.group(2)) - 10) < TOLERANCE
        clock = body["checks"]["clock"]
        assert clock["ok"] is False
        assert abs(clock["offset_seconds"] + 10) < TOLERANCE
        assert 0 <= clock["uncertainty_seconds"] < TOLERANCE
        assert clock["max_skew_seconds"] == 1
        assert clock["reference"] == "Redis TIME"
        assert [r["reference"] for r in clock["references"]] == [REFERENCE, CLOCK_REFERENCE]
        for reference in clock["references"]:
            assert abs(reference["offset_seconds"] + 10) < TOLERANCE
            assert 0 <= reference["uncertainty_seconds"] < TOLERANCE
        assert body["checks"]["replay_store"]["ok"] is True
        assert abs(await _gauge(http) + 10) < TOLERANCE
        assert abs(await _gauge(http, "keystore") + 10) < TOLERANCE

        # What readiness says is what this host does: a request signed now is refused.
        signed = sign_request("GET", "/v1/keys", "", b"", "app", secret)
        refused = await http.get("/v1/keys", headers=signed)
        assert refused.status_code == 401


async def test_a_host_clock_10_s_behind_redis_alone_is_degraded_not_taken_out(
    tmp_path: Path,
) -> None:
    """The file key store has no clock: Redis's is the only reference, and one shared
    machine's clock must not take every host out of the balancer."""
    require_redis()
    async with _service(tmp_path, lambda: time.time() - 10) as (http, _):
        status, body = await _readyz(http)
        assert status == 200, body
        assert body["status"] == "degraded"
        assert len(body["reasons"]) == 1, body
        reason = BEHIND_ONE.fullmatch(body["reasons"][0])
        assert reason, body["reasons"]
        assert abs(float(reason.group(1)) - 10) < TOLERANCE
        clock = body["checks"]["clock"]
        assert clock["ok"] is True
        assert abs(clock["offset_seconds"] + 10) < TOLERANCE
        assert [r["reference"] for r in clock["references"]] == [REFERENCE]
        assert abs(await _gauge(http) + 10) < TOLERANCE
        assert (
            'cryptd_clock_offset_seconds{store="keystore"}' not in (await http.get("/metrics")).text
        )


async def test_a_host_clock_10_s_ahead_of_redis_stays_ready_but_degraded(
    tmp_path: Path,
) -> None:
    require_redis()
    async with _service(tmp_path, lambda: time.time() + 10) as (http, secret):
        status, body = await _readyz(http)
        assert status == 200, body
        assert body["status"] == "degraded"
        assert len(body["reasons"]) == 1, body
        reason = AHEAD.fullmatch(body["reasons"][0])
        assert reason, body["reasons"]
        assert abs(float(reason.group(1)) - 10) < TOLERANCE
        clock = body["checks"]["clock"]
        assert clock["ok"] is True
        assert abs(clock["offset_seconds"] - 10) < TOLERANCE
        assert abs(await _gauge(http) - 10) < TOLERANCE

        # It still serves correctly: the request's age is bounded by Redis's clock.
        signed = sign_request("GET", "/v1/keys", "", b"", "app", secret)
        accepted = await http.get("/v1/keys", headers=signed)
        assert accepted.status_code == 200, accepted.text


async def test_a_host_clock_that_agrees_with_redis_is_ready(tmp_path: Path) -> None:
    require_redis()
    async with _service(tmp_path, time.time) as (http, _):
        status, body = await _readyz(http)
        assert status == 200, body
        assert body["status"] == "ready"
        assert body["reasons"] == []
        clock = body["checks"]["clock"]
        assert clock["ok"] is True
        assert clock["measured"] is True
        assert abs(clock["offset_seconds"]) < TOLERANCE
        assert "reason" not in clock
        assert "degraded" not in clock


async def test_without_redis_there_is_no_clock_check_nor_gauge(tmp_path: Path) -> None:
    async with _service(tmp_path, lambda: time.time() - 10, redis=False) as (http, _):
        answer = await http.get("/readyz")
        assert answer.status_code == 200, answer.text
        assert "clock" not in answer.json()["checks"]
        assert "cryptd_clock_offset_seconds{" not in (await http.get("/metrics")).text


async def test_the_store_measures_the_clock_in_the_readiness_round_trip() -> None:
    """The replay store's health carries the offset of the clock it was given."""
    require_redis()
    client = connect(SHARED_REDIS_URL)
    store = RedisReplayStore(client, clock=lambda: time.time() - 10)
    try:
        health = await store.health()
        assert health.clock is not None
        assert abs(health.clock.offset + 10) < TOLERANCE
        assert 0 <= health.clock.uncertainty < TOLERANCE
    finally:
        await store.aclose()
        await close(client)


def test_the_offset_is_the_round_trip_midpoint_and_half_of_it_the_uncertainty() -> None:
    measured = ClockOffset.measured(sent=1000.0, round_trip=0.2, store_time=1010.0)
    assert measured.offset == pytest.approx(-9.9)
    assert measured.uncertainty == pytest.approx(0.1)
    assert ClockOffset.measured(1000.0, -0.1, 1000.0) == ClockOffset(0.0, 0.0)


@pytest.mark.parametrize(
    ("offset", "uncertainty", "ok", "reason", "degraded"),
    [
        (0.0, 0.0, True, None, None),
        (-1.0, 0.0, True, None, None),  # exactly the skew: created <= now + skew passes
        (-1.5, 0.0, False, "1.5 s behind", None),
        (-1.5, 0.6, True, None, None),  # the round trip could explain all but 0.9 s
        (-10.0, 0.001, False, "10.0 s behind", None),
        (1.5, 0.6, True, None, None),
        (10.0, 0.001, True, None, "10.0 s ahead"),
        (298.0, 0.0, True, None, "298.0 s ahead"),
        (299.5, 0.0, False, "refused as expired (max age 300 s)", None),
    ],
)
def test_the_verdict_counts_only_what_the_uncertainty_cannot_explain(
    offset: float, uncertainty: float, ok: bool, reason: str | None, degraded: str | None
) -> None:
    reading = ClockOffset(offset, uncertainty)
    both = [Reading(REFERENCE, reading), Reading(CLOCK_REFERENCE, reading)]
    verdict = judge(both, max_skew=1, max_age=300)
    assert verdict.ok is ok
    if reason is None:
        assert verdict.reason is None
    else:
        assert verdict.reason is not None
        assert verdict.reason.startswith("clock: ")
        assert reason in verdict.reason
    if degraded is None:
        assert verdict.degraded is None
    else:
        assert verdict.degraded is not None
        assert degraded in verdict.degraded


def _both(redis: float, postgres: float, uncertainty: float = 0.001) -> list[Reading]:
    return [
        Reading(REFERENCE, ClockOffset(redis, uncertainty)),
        Reading(CLOCK_REFERENCE, ClockOffset(postgres, uncertainty)),
    ]


def test_the_reason_reads_as_the_operator_sees_it() -> None:
    assert judge(_both(-10.0, -9.96), max_skew=1, max_age=300) == ClockVerdict(
        False,
        reason="clock: this host's clock is 10.0 s behind Redis TIME and 10.0 s behind "
        "PostgreSQL clock_timestamp(); correctly signed requests are refused as signed in the "
        "future (max skew 1 s)",
    )


@pytest.mark.parametrize(
    "readings",
    [
        [Reading(REFERENCE, ClockOffset(-10.0, 0.001))],  # the file key store: Redis alone
        [Reading(CLOCK_REFERENCE, ClockOffset(-10.0, 0.001))],
        [Reading(REFERENCE, ClockOffset(299.5, 0.0))],  # ahead by the max age: the same
    ],
)
def test_one_reference_alone_never_takes_the_host_out(readings: list[Reading]) -> None:
    verdict = judge(readings, max_skew=1, max_age=300)
    assert verdict.ok is True
    assert verdict.reason is None
    assert verdict.degraded is not None
    assert verdict.degraded.startswith("clock: this host's clock is ")
    assert f"not taken out of service: only one reference ({readings[0].reference})" in (
        verdict.degraded
    )


@pytest.mark.parametrize(
    ("redis", "postgres"),
    [
        (-10.0, 0.0),  # Redis's clock stepped forward: every host would see -10 s
        (0.0, -10.0),  # the database's clock stepped forward
        (-10.0, 10.0),
        (-3.0, -5.5),  # both beyond the skew, but 2.5 s apart: one of them is off
    ],
)
def test_references_that_disagree_make_it_degraded_never_not_ready(
    redis: float, postgres: float
) -> None:
    verdict = judge(_both(redis, postgres), max_skew=1, max_age=300)
    assert verdict.ok is True
    assert verdict.reason is None
    assert verdict.degraded is not None
    assert "the references disagree by" in verdict.degraded
    assert "one of them may be off" in verdict.degraded
    assert f"{abs(redis):.1f} s" in verdict.degraded
    assert f"{abs(postgres):.1f} s" in verdict.degraded


def test_references_that_agree_but_not_both_beyond_the_limit_make_it_degraded() -> None:
    verdict = judge(_both(-1.6, -0.8), max_skew=1, max_age=300)
    assert verdict.ok is True
    assert verdict.degraded is not None
    assert "the references do not both put it beyond the limit" in verdict.degraded


def test_ahead_of_both_is_degraded_and_by_the_max_age_not_ready() -> None:
    ahead = judge(_both(10.0, 10.1), max_skew=1, max_age=300)
    assert ahead.ok is True
    assert ahead.degraded is not None
    assert "expire here 10.0 s early" in ahead.degraded
    expired = judge(_both(299.5, 299.6), max_skew=1, max_age=300)
    assert expired.ok is False
    assert expired.reason is not None
    assert "refused as expired (max age 300 s)" in expired.reason


def test_no_reading_is_no_verdict() -> None:
    assert judge([], max_skew=1, max_age=300) == ClockVerdict(True)


def test_the_postgresql_store_reads_its_server_clock_in_the_announcement(
    pg_database: str,
) -> None:
    """No statement of its own: the announcement every heartbeat brings the reading."""
    store = PostgresKeyStore(pg_database)
    try:
        initialise(store, MasterKey(secrets.token_bytes(32)))
        assert store.server_clock() is None  # nothing announced yet
        before = time.monotonic()
        store.announce("0" * 32, 1)
        read = store.server_clock()
        assert read is not None
        assert read.reference == CLOCK_REFERENCE
        assert before <= read.sent <= time.monotonic()
        assert 0 <= read.round_trip < TOLERANCE
        assert abs(read.server_time - time.time()) < TOLERANCE
    finally:
        store.close()


def test_the_file_store_has_no_server_clock(tmp_path: Path) -> None:
    store: KeyStore = FileKeyStore(tmp_path / "keyring.json")
    store.announce("0" * 32, 1)
    assert store.server_clock() is None
