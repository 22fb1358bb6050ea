"""This host's clock against the shared replay store's, in /readyz (service/auth/clock.py,
service/api/replay_readiness.py): the real application on the real Redis, its clock set 10 s
behind, 10 s ahead or right; and the offset/uncertainty decision on its own."""

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

from service.api.application import create_app
from service.auth.clock import ClockOffset, ClockVerdict, judge
from service.auth.redis_client import close, connect
from service.auth.replay import RedisReplayStore
from service.auth.signature import sign_request
from service.config import Settings
from service.keys.admin import create_keyring_file
from service.keys.masterkey import MasterKey
from tests.test_auth_support import SHARED_REDIS_URL, require_redis, standard_clients

# Generous: the offset is measured over a local round trip (well under a millisecond when the
# machine is quiet); a loaded CI machine may stretch it to tens of milliseconds.
TOLERANCE = 0.5
BEHIND = re.compile(
    r"clock: this host's clock is (\d+\.\d) s behind the replay store's \(Redis TIME\); "
    r"correctly signed requests are refused as signed in the future \(max skew 1 s\)"
)
AHEAD = re.compile(
    r"clock: this host's clock is (\d+\.\d) s ahead of the replay store's \(Redis TIME\); "
    r"requests are still accepted \(the store's clock bounds their age\), but expire here "
    r"\d+\.\d s early \(max skew 1 s, max age 300 s\)"
)


@asynccontextmanager
async def _service(
    tmp_path: Path, clock: Callable[[], float], *, redis: bool = True
) -> AsyncIterator[tuple[httpx.AsyncClient, bytes]]:
    """The whole application with ``clock``, on the shared Redis (or its memory store), and
    the secret of its client ``app``."""
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    keyring = tmp_path / "keyring.json"
    create_keyring_file(keyring, MasterKey(master))
    clients = tmp_path / "clients.json"
    secret = base64.b64decode(standard_clients(clients)["app"])
    settings = Settings(
        env="production",
        tls="off",  # called in-process: no socket, no TLS to terminate
        master_key_file=tmp_path / "master.key",
        keyring_file=keyring,
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


async def _gauge(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    found = re.search(r'^cryptd_clock_offset_seconds\{store="replay"\} (\S+)$', text, re.M)
    assert found, text
    return float(found.group(1))


async def test_a_host_clock_10_s_behind_redis_is_not_ready_and_names_the_offset(
    tmp_path: Path,
) -> None:
    require_redis()
    async with _service(tmp_path, lambda: time.time() - 10) as (http, secret):
        status, body = await _readyz(http)
        assert status == 503, body
        assert body["status"] == "not_ready"
        assert len(body["reasons"]) == 1, body
        reason = BEHIND.fullmatch(body["reasons"][0])
        assert reason, body["reasons"]
        assert abs(float(reason.group(1)) - 10) < TOLERANCE
        clock = body["checks"]["clock"]
        assert clock["ok"] is False
        assert abs(clock["offset_seconds"] + 10) < TOLERANCE
        assert 0 <= clock["uncertainty_seconds"] < TOLERANCE
        assert clock["max_skew_seconds"] == 1
        assert clock["reference"] == "Redis TIME"
        assert body["checks"]["replay_store"]["ok"] is True
        assert abs(await _gauge(http) + 10) < TOLERANCE

        # What readiness says is what this host does: a request signed now is refused.
        signed = sign_request("GET", "/v1/keys", "", b"", "app", secret)
        refused = await http.get("/v1/keys", headers=signed)
        assert refused.status_code == 401


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
    verdict = judge(ClockOffset(offset, uncertainty), max_skew=1, max_age=300)
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


def test_the_reason_reads_as_the_operator_sees_it() -> None:
    assert judge(ClockOffset(-10.0, 0.0002), max_skew=1, max_age=300) == ClockVerdict(
        False,
        reason="clock: this host's clock is 10.0 s behind the replay store's (Redis TIME); "
        "correctly signed requests are refused as signed in the future (max skew 1 s)",
    )
