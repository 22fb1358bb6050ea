"""``cryptd serve`` with two worker processes, a known signed load, then /metrics parsed as
Prometheus would: counts equal what was sent, per route and per operation, whichever worker
answers; the window P50/P99 agree with the client's latencies and the histogram; a killed
worker's replacement double counts nothing; decrypt and sign are audited; the server's log
holds no plaintext, ciphertext, secret or signature."""

from __future__ import annotations

import base64
import math
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.auth.signature import sign_request
from service.metrics.window import RELATIVE_ACCURACY
from tests.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ENCRYPT = "/v1/encrypt/{key}"
SIGN = "/v1/sign/{key}"
PLAINTEXT = b"metrics-test plaintext \x00\x01 never logged"


@pytest.fixture(scope="module")
def cryptd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("metrics-server"), workers=2)
    yield running
    stop_server(running)


@pytest.fixture
def fresh_cryptd(tmp_path: Path) -> Iterator[Server]:
    """A server of its own: its latency window holds exactly what the test sends."""
    running = start_server(tmp_path / "server", workers=2)
    yield running
    stop_server(running)


def scrape(server: Server) -> Samples:
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    found: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def auth_failures(found: Samples) -> float:
    return sum(v for (name, _), v in found.items() if name == "cryptd_auth_failures_total")


def signed_load(server: Server, path: str, bodies: list[bytes]) -> list[tuple[int, float, bytes]]:
    """POST each body, signed, over 8 connections; (status, client latency, response body)."""

    with httpx.Client(headers={"connection": "close"}, timeout=30) as http:

        def one(body: bytes) -> tuple[int, float, bytes]:
            headers = sign_request("POST", path, "", body, server.client_id, server.secret)
            started = time.perf_counter()
            response = http.post(server.url + path, content=body, headers=headers)
            return response.status_code, time.perf_counter() - started, response.content

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, bodies))


def test_known_load_is_counted_exactly_with_agreeing_quantiles(fresh_cryptd: Server) -> None:
    cryptd = fresh_cryptd
    before = scrape(cryptd)
    plaintext = base64.b64encode(PLAINTEXT).decode()
    encrypted = signed_load(
        cryptd, "/v1/encrypt/aes256-gcm", [orjson.dumps({"plaintext": plaintext})] * 300
    )
    assert {status for status, _, _ in encrypted} == {200}
    batch = orjson.dumps({"batch": [{"message": plaintext}] * 10})
    signed = signed_load(cryptd, "/v1/sign/ed25519", [batch] * 20)
    assert {status for status, _, _ in signed} == {200}
    unsigned = [httpx.post(cryptd.url + "/v1/decrypt/aes256-gcm", json={}) for _ in range(6)]
    assert {response.status_code for response in unsigned} == {401}

    def delta(found: Samples, name: str, **labels: str) -> float:
        return value(found, name, **labels) - value(before, name, **labels)

    total = "cryptd_http_requests_total"
    for _ in range(4):  # whichever worker answers, the totals are the service's
        found = scrape(cryptd)
        assert delta(found, total, route=ENCRYPT, method="POST", status="200") == 300
        assert delta(found, total, route=SIGN, method="POST", status="200") == 20
        assert delta(found, total, route="/v1/decrypt/{key}", method="POST", status="401") == 6
        ops = "cryptd_crypto_operations_total"
        assert delta(found, ops, operation="encrypt", key_type="aes256-gcm", outcome="ok") == 300
        assert delta(found, ops, operation="sign", key_type="ed25519", outcome="ok") == 200
        failures = sum(v for (name, _), v in found.items() if name == "cryptd_auth_failures_total")
        failures -= sum(
            v for (name, _), v in before.items() if name == "cryptd_auth_failures_total"
        )
        assert failures == 6

    window = {"route": ENCRYPT, "method": "POST"}
    deadline = time.monotonic() + 15
    while True:  # every worker publishes its window within a second
        found = scrape(cryptd)
        seen = value(found, "cryptd_http_request_window_observations", **window)
        if seen >= 300 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert seen == 300
    latencies = sorted(latency for _, latency, _ in encrypted)
    histogram = {**window, "status": "200"}
    count = value(found, "cryptd_http_request_duration_seconds_count", **histogram)
    edges = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in found.items()
        if name == "cryptd_http_request_duration_seconds_bucket"
        and {k: v for k, v in labels if k != "le"} == histogram
    )
    tolerance = 1 + RELATIVE_ACCURACY
    for q in (0.5, 0.99):
        gauge = value(found, "cryptd_http_request_duration_window_seconds", quantile=repr(q),
                      **window)  # fmt: skip
        assert gauge <= latencies[math.floor(q * (len(latencies) - 1))] * tolerance, q
        rank = math.floor(q * (count - 1))
        index = next(i for i, (_, cumulative) in enumerate(edges) if cumulative > rank)
        lower = edges[index - 1][0] if index else 0.0
        assert lower / tolerance <= gauge <= edges[index][0] * tolerance, (q, gauge)


def test_server_log_holds_no_secret(cryptd: Server) -> None:
    plaintext = base64.b64encode(PLAINTEXT).decode()
    encrypted = signed_load(cryptd, "/v1/encrypt/aes256-gcm",
                            [orjson.dumps({"plaintext": plaintext})] * 5)  # fmt: skip
    tokens = [orjson.loads(body)["ciphertext"] for _, _, body in encrypted]
    signatures = signed_load(cryptd, "/v1/sign/ed25519", [orjson.dumps({"message": plaintext})])
    signature = orjson.loads(signatures[0][2])["signature"]
    headers = sign_request("POST", "/v1/encrypt/x", "", b"{}", cryptd.client_id, cryptd.secret)
    time.sleep(0.3)  # log lines are written within 50 ms
    log = Path(cryptd.log_path).read_text(errors="replace").splitlines()
    # `cryptd serve --dev` shows the development secret once, by design, before any worker.
    served = [line for line in log if not line.startswith("cryptd: ")]
    text = "\n".join(served)
    secret = base64.b64encode(cryptd.secret).decode()
    for forbidden in (plaintext, PLAINTEXT.decode(errors="replace"), secret, signature,
                      headers["Signature"], *tokens):  # fmt: skip
        assert forbidden not in text


def test_decrypt_and_sign_are_audited(cryptd: Server) -> None:
    plaintext = base64.b64encode(PLAINTEXT).decode()
    (encrypted,) = signed_load(cryptd, "/v1/encrypt/aes256-gcm",
                               [orjson.dumps({"plaintext": plaintext})])  # fmt: skip
    token = orjson.loads(encrypted[2])["ciphertext"]
    decrypted = signed_load(cryptd, "/v1/decrypt/aes256-gcm",
                            [orjson.dumps({"ciphertext": token})] * 3)  # fmt: skip
    assert {status for status, _, _ in decrypted} == {200}
    signed = signed_load(cryptd, "/v1/sign/ed25519", [orjson.dumps({"message": plaintext})])
    assert signed[0][0] == 200
    deadline = time.monotonic() + 5
    while True:  # audit lines reach stderr within 50 ms
        records = [
            orjson.loads(line)
            for line in Path(cryptd.log_path).read_text(errors="replace").splitlines()
            if line.startswith("{") and '"cryptd.audit"' in line
        ]
        decrypts = [r for r in records if r["event"] == "decrypt" and r["key"] == "aes256-gcm"]
        signs = [r for r in records if r["event"] == "sign" and r["key"] == "ed25519"]
        if (len(decrypts) >= 3 and signs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(decrypts) >= 3
    assert signs
    for record in (*decrypts, *signs):
        assert record["client"] == cryptd.client_id
        assert record["outcome"] == "ok"
        assert record["key_version"] in (1, [1])
        assert record["ts"].endswith("Z")


def test_a_killed_worker_is_replaced_without_double_counting(cryptd: Server) -> None:
    plaintext = base64.b64encode(PLAINTEXT).decode()
    body = orjson.dumps({"plaintext": plaintext})
    labels = {"route": ENCRYPT, "method": "POST", "status": "200"}
    path = "/v1/encrypt/aes256-gcm"
    before = value(scrape(cryptd), "cryptd_http_requests_total", **labels)
    assert {status for status, _, _ in signed_load(cryptd, path, [body] * 50)} == {200}
    assert value(scrape(cryptd), "cryptd_http_requests_total", **labels) == before + 50

    def workers() -> list[int]:
        found = []
        for task in Path(f"/proc/{cryptd.process.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
        return found

    victim = workers()[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (len(workers()) == 2 and victim not in workers()):
        assert time.monotonic() < deadline, "no replacement worker"
        time.sleep(0.2)
    time.sleep(1.0)  # the replacement's startup (keyring, executors)
    assert {status for status, _, _ in signed_load(cryptd, path, [body] * 50)} == {200}
    for _ in range(4):  # the dead worker's counts stay, none are counted twice
        assert value(scrape(cryptd), "cryptd_http_requests_total", **labels) == before + 100
