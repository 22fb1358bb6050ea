"""Metrics in one process, driven through a small FastAPI app wrapped by the timing middleware."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Query
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

from service.api.timing import route_template, timed
from service.asgi import ASGIApp, Receive, Scope, Send, send_error
from service.metrics import LATENCY_BUCKETS, Metrics
from service.metrics.batch import apply, supports_direct_buckets
from service.metrics.window import RELATIVE_ACCURACY

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: Metrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    found: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


class RejectUnsigned:
    """Stands in for the signature check: answers 401 before routing, like the real one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"x-unsigned"):
            await send_error(send, 401, "unauthenticated", "request signature required")
            return
        await self.app(scope, receive, send)


def build_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/encrypt/{key}")
    async def encrypt(key: str) -> dict[str, str]:
        return {"key": key}

    @app.get("/v1/sleep/{key}")
    async def sleep(key: str, ms: float = Query(0.0)) -> dict[str, str]:
        await asyncio.sleep(ms / 1000.0)
        return {"key": key}

    @app.get("/v1/fail")
    async def fail() -> None:
        raise RuntimeError("boom")

    # Routes of an included router, as the real app has them.
    router = APIRouter(prefix="/v1")

    @router.post("/sign/{key}")
    async def sign(key: str) -> dict[str, str]:
        return {"key": key}

    app.include_router(router)
    app.add_middleware(RejectUnsigned)
    return app


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(metrics: Metrics) -> AsyncIterator[httpx.AsyncClient]:
    wrapped = timed(metrics, build_app())
    transport = httpx.ASGITransport(app=wrapped, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_counts_equal_requests_sent_per_route_method_and_status(
    metrics: Metrics, client: httpx.AsyncClient
) -> None:
    for index in range(37):
        assert (await client.post(f"/v1/encrypt/key-{index}")).status_code == 200
    for _ in range(5):
        assert (await client.get("/v1/encrypt/k")).status_code == 405
    for index in range(3):
        assert (await client.get(f"/no/such/path/{index}")).status_code == 404
    for _ in range(4):
        response = await client.post("/v1/encrypt/k", headers={"x-unsigned": "1"})
        assert response.status_code == 401
    assert (await client.get("/v1/fail")).status_code == 500
    for _ in range(2):
        assert (await client.post("/v1/sign/k")).status_code == 200
        response = await client.post("/v1/sign/k", headers={"x-unsigned": "1"})
        assert response.status_code == 401
    assert (await client.get("/v1/sign/k")).status_code == 405

    found = samples(metrics)
    route = "/v1/encrypt/{key}"
    total = "cryptd_http_requests_total"
    assert value(found, total, route=route, method="POST", status="200") == 37
    assert value(found, total, route=route, method="GET", status="405") == 5
    assert value(found, total, route=route, method="POST", status="401") == 4
    assert value(found, total, route="unmatched", method="GET", status="404") == 3
    assert value(found, total, route="/v1/fail", method="GET", status="500") == 1
    # An included router's routes, answered by the route or refused before routing.
    assert value(found, total, route="/v1/sign/{key}", method="POST", status="200") == 2
    assert value(found, total, route="/v1/sign/{key}", method="POST", status="401") == 2
    assert value(found, total, route="/v1/sign/{key}", method="GET", status="405") == 1
    count = "cryptd_http_request_duration_seconds_count"
    assert value(found, count, route=route, method="POST", status="200") == 37
    assert sum(v for (name, _), v in found.items() if name == total) == 55
    # Raw paths (key names, junk) never become label values.
    body = metrics.render()[0].decode()
    assert "key-1" not in body
    assert "/no/such" not in body


async def test_unknown_methods_share_one_label(metrics: Metrics, client: httpx.AsyncClient) -> None:
    for method in ("FOO", "BAR", "BAZ"):
        await client.request(method, "/v1/encrypt/k")
    found = samples(metrics)
    labels = [dict(key[1]) for key in found if key[0] == "cryptd_http_requests_total"]
    assert {label["method"] for label in labels} == {"other"}
    assert value(found, "cryptd_http_requests_total", route="/v1/encrypt/{key}", method="other",
                 status="405") == 3  # fmt: skip


async def test_histogram_sum_and_buckets_bound_the_known_sleeps(
    metrics: Metrics, client: httpx.AsyncClient
) -> None:
    sleeps_ms = [12.0, 12.0, 25.0, 25.0, 25.0]
    client_seconds = 0.0
    for ms in sleeps_ms:
        started = time.perf_counter()
        assert (await client.get("/v1/sleep/k", params={"ms": ms})).status_code == 200
        client_seconds += time.perf_counter() - started

    found = samples(metrics)
    labels = {"route": "/v1/sleep/{key}", "method": "GET", "status": "200"}
    total = value(found, "cryptd_http_request_duration_seconds_sum", **labels)
    # Each request took at least its sleep and at most what the client waited for it.
    assert sum(sleeps_ms) / 1000.0 <= total <= client_seconds
    bucket = "cryptd_http_request_duration_seconds_bucket"
    assert value(found, bucket, le="0.01", **labels) == 0
    assert value(found, bucket, le="+Inf", **labels) == 5
    assert value(found, bucket, le="0.02", **labels) <= 2


async def test_window_quantiles_agree_with_known_latencies_within_tolerance(
    metrics: Metrics, client: httpx.AsyncClient
) -> None:
    """90 requests sleeping 3 ms, 10 sleeping 40 ms. The middleware's time for a request is at
    least its sleep and at most what the client measured around it, so each server-side order
    statistic lies between the sleep's and the client's; the gauge is that order statistic
    within the sketch's relative accuracy."""
    plan = [3.0] * 90 + [40.0] * 10
    measured: list[float] = []
    for ms in plan:
        started = time.perf_counter()
        await client.get("/v1/sleep/k", params={"ms": ms})
        measured.append(time.perf_counter() - started)

    found = samples(metrics)
    route = {"route": "/v1/sleep/{key}", "method": "GET"}
    assert value(found, "cryptd_http_request_window_observations", **route) == 100
    window = "cryptd_http_request_duration_window_seconds"
    tolerance = 1 + RELATIVE_ACCURACY
    for q, slept_ms in ((0.5, 3.0), (0.99, 40.0)):
        gauge = value(found, window, quantile=repr(q), **route)
        client_q = sorted(measured)[math.floor(q * (len(measured) - 1))]
        assert slept_ms / 1000.0 / tolerance <= gauge <= client_q * tolerance, q


async def test_crypto_batches_count_each_item_at_the_mean_time(metrics: Metrics) -> None:
    metrics.observe_crypto("encrypt", "aes256-gcm", 0.0064, "ok", items=64)
    metrics.observe_crypto("encrypt", "aes256-gcm", 0.0001)
    metrics.observe_crypto("decrypt", "aes256-gcm", 0.002, "error")
    metrics.observe_crypto("sign", "rsa-2048", 0.0, "ok", items=0)  # nothing ran: ignored
    found = samples(metrics)
    ops = "cryptd_crypto_operations_total"
    assert value(found, ops, operation="encrypt", key_type="aes256-gcm", outcome="ok") == 65
    assert value(found, ops, operation="decrypt", key_type="aes256-gcm", outcome="error") == 1
    assert not any(dict(labels).get("key_type") == "rsa-2048" for _, labels in found)
    labels = {"operation": "encrypt", "key_type": "aes256-gcm"}
    ok = {**labels, "outcome": "ok"}
    assert value(found, "cryptd_crypto_operation_duration_seconds_count", **ok) == 65
    assert value(found, "cryptd_crypto_operation_duration_seconds_sum", **ok) == (
        pytest.approx(0.0065)
    )
    assert value(found, "cryptd_crypto_operation_duration_seconds_bucket", le="0.0001",
                 **ok) == 65  # fmt: skip
    p50 = value(found, "cryptd_crypto_operation_duration_window_seconds", quantile="0.5", **labels)
    assert p50 == pytest.approx(0.0001, rel=RELATIVE_ACCURACY)
    assert value(found, "cryptd_crypto_operation_window_observations", **labels) == 65


def test_weighted_observation_equals_repeated_observations() -> None:
    """The batch shortcut writes prometheus-client's bucket counts directly: pin that it
    produces exactly what ``items`` separate observations would, at every bucket edge."""
    durations = [LATENCY_BUCKETS[0] / 2, *LATENCY_BUCKETS, LATENCY_BUCKETS[-1] * 3, 0.0003]
    weighted, repeated = Metrics(), Metrics()
    for seconds in durations:
        weighted.observe_crypto("sign", "ed25519", seconds * 7, items=7)
        for _ in range(7):
            repeated.observe_crypto("sign", "ed25519", seconds)
    a, b = samples(weighted), samples(repeated)
    histogram = {key: v for key, v in a.items() if key[0].startswith("cryptd_crypto_operation_dur")}
    assert histogram
    for key, found in histogram.items():
        if key[0].endswith("_sum"):
            assert found == pytest.approx(b[key])
        else:
            assert found == b[key], key


def test_pool_auth_rejection_and_keyring_series(metrics: Metrics) -> None:
    metrics.pool_gauges(7, 2, max_pending=2048)
    metrics.pool_gauges(1, 3, executor="thread")
    metrics.pool_gauges(4, 2)  # gauges hold the latest value
    metrics.queue_wait(0.0015)
    metrics.queue_wait(0.3)
    for reason in ("bad_signature", "bad_signature", "replayed"):
        metrics.auth_failure(reason)
    for cause in ("overload", "rate_limit", "body_size", "overload", "rate_limited"):
        metrics.rejected(cause)
    metrics.keyring_reload(True)
    metrics.keyring_reload(False)
    found = samples(metrics)
    assert value(found, "cryptd_pool_queued", executor="process") == 4
    assert value(found, "cryptd_pool_in_flight", executor="process") == 2
    assert value(found, "cryptd_pool_queued", executor="thread") == 1
    assert value(found, "cryptd_pool_max_pending", executor="process") == 2048
    assert value(found, "cryptd_pool_queue_wait_seconds_count", executor="process") == 2
    assert value(found, "cryptd_pool_queue_wait_seconds_bucket", executor="process",
                 le="0.002") == 1  # fmt: skip
    assert value(found, "cryptd_auth_failures_total", reason="bad_signature") == 2
    assert value(found, "cryptd_auth_failures_total", reason="replayed") == 1
    assert value(found, "cryptd_rejections_total", cause="overload") == 2
    assert value(found, "cryptd_rejections_total", cause="body_size") == 1
    assert value(found, "cryptd_rejections_total", cause="rate_limit") == 2  # either spelling
    assert value(found, "cryptd_keyring_reloads_total", outcome="error") == 1


def test_build_info_and_window_length_are_exported() -> None:
    found = samples(Metrics(window_seconds=30.0))
    info = [dict(labels) for name, labels in found if name == "cryptd_build_info"]
    assert len(info) == 1
    assert set(info[0]) == {"version", "python", "openssl"}
    assert info[0]["openssl"].startswith(("OpenSSL", "LibreSSL", "BoringSSL", "AWS-LC"))
    assert value(found, "cryptd_latency_window_seconds") == 30.0


def test_disabled_metrics_cost_nothing_and_render_nothing() -> None:
    metrics = Metrics(enabled=False)
    app = build_app()
    assert timed(metrics, app) is app
    metrics.observe_crypto("encrypt", "aes256-gcm", 0.001)
    metrics.auth_failure("bad_signature")
    metrics.pool_gauges(1, 1)
    assert metrics.render()[0] == b""


async def test_access_log_without_metrics_still_gets_one_timing() -> None:
    seen: list[tuple[str, int, float]] = []

    def access_log(scope: Scope, route: str, status: int, seconds: float) -> None:
        seen.append((route, status, seconds))

    wrapped = timed(Metrics(enabled=False), build_app(), access_log=access_log)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        await http.post("/v1/encrypt/k")
    assert len(seen) == 1
    assert seen[0][:2] == ("/v1/encrypt/{key}", 200)
    assert seen[0][2] > 0


async def test_a_failing_observer_never_fails_the_request(metrics: Metrics) -> None:
    def broken(scope: Scope, route: str, status: int, seconds: float) -> None:
        raise RuntimeError("observer bug")

    wrapped = timed(metrics, build_app(), access_log=broken)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        assert (await http.post("/v1/encrypt/k")).status_code == 200
    found = samples(metrics)
    labels = {"route": "/v1/encrypt/{key}", "method": "POST", "status": "200"}
    assert value(found, "cryptd_http_requests_total", **labels) == 1


async def test_non_http_scopes_pass_through(metrics: Metrics) -> None:
    calls: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append(scope["type"])

    async def receive() -> dict[str, Any]:
        return {}

    async def send(message: Any) -> None:
        return None

    wrapped = timed(metrics, app)
    await wrapped({"type": "lifespan"}, receive, send)
    assert calls == ["lifespan"]
    assert not any(name.startswith("cryptd_http_requests") for name, _ in samples(metrics))


def test_route_template_without_an_app_is_unmatched() -> None:
    assert route_template({"type": "http", "path": "/v1/encrypt/k", "method": "POST"}) == (
        "unmatched"
    )


def histogram_samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in histogram.collect()
        for sample in family.samples
    }


async def test_request_observations_are_applied_by_the_end_of_the_loop_iteration(
    metrics: Metrics,
) -> None:
    for _ in range(3):
        metrics.observe_request("/v1/encrypt/{key}", "POST", 200, 0.0004)
    counts = histogram_samples(metrics._families.http_duration)
    assert counts.get(("cryptd_http_request_duration_seconds_count", ""), 0) == 0  # queued
    await asyncio.sleep(0)  # the iteration ends: one callback applies the batch
    counts = histogram_samples(metrics._families.http_duration)
    assert counts[("cryptd_http_request_duration_seconds_count", "")] == 3
    assert counts[("cryptd_http_request_duration_seconds_bucket", "0.0005")] == 3


def test_request_observations_outside_a_loop_apply_at_once(metrics: Metrics) -> None:
    metrics.observe_request("/v1/encrypt/{key}", "POST", 200, 0.0004)
    counts = histogram_samples(metrics._families.http_duration)
    assert counts[("cryptd_http_request_duration_seconds_count", "")] == 1


def test_batched_application_equals_one_observe_per_value() -> None:
    """The batch writes prometheus-client's per-bucket counts directly: pin that it produces
    exactly what separate observe() calls would, at and around every bucket edge."""
    values = [edge * factor for edge in LATENCY_BUCKETS for factor in (0.5, 1.0, 1.000001)]
    values += [0.0, 7.5, 1e-9, 0.0003, 0.0003]
    batched = Histogram("t_seconds", "t", buckets=LATENCY_BUCKETS, registry=None)
    separate = Histogram("t_seconds", "t", buckets=LATENCY_BUCKETS, registry=None)
    assert supports_direct_buckets(batched)
    weighted = [(value, 1 + index % 3) for index, value in enumerate(values)]
    apply(batched, weighted)
    for value, weight in weighted:
        for _ in range(weight):
            separate.observe(value)
    a, b = histogram_samples(batched), histogram_samples(separate)
    assert a.keys() == b.keys()
    for key, found in a.items():
        assert found == pytest.approx(b[key]), key


def test_observations_left_by_an_ended_loop_are_applied_by_the_next() -> None:
    metrics = Metrics()

    async def observe() -> None:
        metrics.observe_request("/v1/encrypt/{key}", "POST", 200, 0.0004)

    async def observe_and_stop() -> None:
        await observe()
        asyncio.get_running_loop().stop()  # the loop ends before the flush it scheduled runs

    abandoned = asyncio.new_event_loop()
    try:
        abandoned.run_until_complete(observe_and_stop())
    finally:
        abandoned.close()
    count = ("cryptd_http_request_duration_seconds_count", "")
    assert histogram_samples(metrics._families.http_duration).get(count, 0) == 0

    async def observe_again() -> None:
        await observe()
        await asyncio.sleep(0)

    asyncio.run(observe_again())
    assert histogram_samples(metrics._families.http_duration)[count] == 2
