"""Key usage counts: real servers with several workers, the SQLite file beside the keyring and
the real PostgreSQL; the counts in ``GET /v1/keys/{key}`` equal the requests sent, whichever
worker or replica answered them, without a store write per request; the metric and its cap."""

from __future__ import annotations

import base64
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest

from cryptd_client import CryptdClient
from service.auth.signature import sign_request
from tests.conftest import Server, connections_to_every_worker, start_server, stop_server
from tests.test_keystore_support import replicas, wait_for

pytestmark = pytest.mark.slow  # live servers of several workers, waiting for their flushes

FAST = {"CRYPTD_USAGE_FLUSH_INTERVAL": "0.2"}
PLAINTEXT = base64.b64encode(b"usage").decode()


def send(client: httpx.Client, server: Server, op: str, key: str, body: Any) -> httpx.Response:
    content = orjson.dumps(body)
    path = f"/v1/{op}/{key}"
    headers = sign_request("POST", path, "", content, server.client_id, server.secret)
    response = client.post(path, content=content, headers=headers)
    assert response.status_code == 200, response.text
    return response


def versions(server: Server, key: str) -> dict[int, dict[str, Any]]:
    response = server.request("GET", f"/v1/keys/{key}")
    assert response.status_code == 200, response.text
    return {v["version"]: v["usage"] for v in response.json()["versions"]}


def metric(server: Server, name: str) -> dict[str, float]:
    """Every sample of ``name``, by its label text."""
    text = server.request("GET", "/metrics", sign=False).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            found[match.group(1) or ""] = float(match.group(2))
    return found


def flushes(server: Server) -> float:
    return metric(server, "cryptd_usage_flushes_total").get('{outcome="ok"}', 0.0)


def latest_version(client: httpx.Client, server: Server, key: str) -> int:
    path = f"/v1/keys/{key}"
    headers = sign_request("GET", path, "", b"", server.client_id, server.secret)
    return int(client.get(path, headers=headers).json()["latest_version"])


def worker_versions(client: httpx.Client, server: Server, key: str) -> dict[int, Any]:
    path = f"/v1/keys/{key}"
    headers = sign_request("GET", path, "", b"", server.client_id, server.secret)
    return {v["version"]: v["usage"] for v in client.get(path, headers=headers).json()["versions"]}


def settle_everywhere(server: Server, key: str, check: Callable[[dict[int, Any]], bool]) -> None:
    """Wait until every worker's answer passes ``check``: the others have flushed too."""
    with connections_to_every_worker(server, 2) as clients:
        for client in clients.values():

            def flushed(c: httpx.Client = client) -> bool:
                return check(worker_versions(c, server, key))

            settle(flushed)


def settle(condition: Callable[[], bool]) -> None:
    """Wait for the workers' flushes (a few intervals on a busy machine)."""
    wait_for(condition, timeout=15, what="the flushed counts")


def parse_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


@pytest.fixture
def two_workers(tmp_path: Path) -> Any:
    server = start_server(tmp_path, FAST, workers=2)
    yield server
    stop_server(server)


def test_counts_from_every_worker_add_up_exactly(two_workers: Server) -> None:
    server = two_workers
    sent = {0: 0, 1: 0}
    started = time.time()
    with connections_to_every_worker(server, 2) as clients:
        token = ""
        for n in range(60):
            worker = n % 2
            answer = send(
                clients[worker], server, "encrypt", "aes256-gcm", {"plaintext": PLAINTEXT}
            )
            sent[worker] += 1
            token = answer.json()["ciphertext"]
        # A batch counts per item; failed items count nowhere.
        batch = [{"ciphertext": token}] * 7 + [{"ciphertext": "cryptd:v1:AAAA"}]
        results = send(clients[1], server, "decrypt", "aes256-gcm", {"batch": batch}).json()
        assert sum("error" in r for r in results["batch"]) == 1
        send(clients[0], server, "rewrap", "aes256-gcm", {"ciphertext": token, "to_key": "sm4-gcm"})
    assert sent == {0: 30, 1: 30}
    # Once every worker has flushed (an interval, or a few on a busy machine) the figure is
    # exact whichever worker answers.
    settle_everywhere(server, "aes256-gcm", lambda u: u[1]["total"] == 68)
    for _ in range(4):  # whichever worker answers the read
        usage = versions(server, "aes256-gcm")[1]
        assert usage["operations"] == {
            "encrypt": 60,
            "decrypt": 7,
            "sign": 0,
            "verify": 0,
            "hmac": 0,
            "datakey": 0,
            "rewrap_from": 1,
            "rewrap_to": 0,
            "encapsulate": 0,
            "decapsulate": 0,
        }
        assert usage["total"] == 68
        assert versions(server, "sm4-gcm")[1]["operations"]["rewrap_to"] == 1
    last = parse_time(usage["last_used_at"])
    assert int(started) <= last <= time.time()
    assert versions(server, "ed25519")[1] == {
        "operations": dict.fromkeys(usage["operations"], 0),
        "total": 0,
        "last_used_at": None,
    }
    usage_check = server.request("GET", "/readyz", sign=False).json()["checks"]["usage"]
    assert usage_check == {"ok": True, "backend": "sqlite", "stored": True}
    # Writes follow the clock, not the requests: at most one per worker and interval.
    elapsed = time.time() - started
    assert 0 < flushes(server) <= 2 * (elapsed / 0.2 + 2)
    # The file beside the keyring holds them.
    path = server.directory / "dev" / "keyring.usage.sqlite"
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT operation, count FROM key_usage WHERE key = 'aes256-gcm' ORDER BY operation"
        ).fetchall()
    assert rows == [("decrypt", 7), ("encrypt", 60), ("rewrap_from", 1)]
    assert path.stat().st_mode & 0o077 == 0


def test_the_metric_counts_per_key_version_and_operation(two_workers: Server) -> None:
    server = two_workers
    for _ in range(5):
        server.request("POST", "/v1/sign/ed25519", {"message": PLAINTEXT})
    signature = server.request("POST", "/v1/sign/ed25519", {"message": PLAINTEXT}).json()
    server.request(
        "POST", "/v1/verify/ed25519", {"message": PLAINTEXT, "signature": signature["signature"]}
    )
    mac = server.request("POST", "/v1/hmac/hmac-sha256", {"message": PLAINTEXT}).json()["mac"]
    server.request("POST", "/v1/verify/hmac-sha256", {"message": PLAINTEXT, "mac": mac})
    server.request("POST", "/v1/datakey/aes256-gcm", {"plaintext": False})

    def counted() -> dict[str, float]:
        return metric(server, "cryptd_key_operations_total")

    expected = {
        '{key="ed25519",operation="sign",version="1"}': 6.0,
        '{key="ed25519",operation="verify",version="1"}': 1.0,
        '{key="hmac-sha256",operation="hmac",version="1"}': 1.0,
        '{key="hmac-sha256",operation="verify",version="1"}': 1.0,
        '{key="aes256-gcm",operation="datakey",version="1"}': 1.0,
    }
    wait_for(lambda: counted() == expected, timeout=10, what=f"the metric: {counted()}")
    assert versions(server, "ed25519")[1]["operations"]["verify"] == 1
    assert versions(server, "hmac-sha256")[1]["operations"]["verify"] == 1


def test_versions_are_counted_apart(two_workers: Server) -> None:
    server = two_workers
    old = server.request("POST", "/v1/encrypt/sm4-gcm", {"plaintext": PLAINTEXT}).json()
    assert server.request("POST", "/v1/keys/sm4-gcm/rotate").status_code == 200
    with connections_to_every_worker(server, 2) as clients:  # both have reloaded it
        for client in clients.values():

            def reloaded(c: httpx.Client = client) -> bool:
                return latest_version(c, server, "sm4-gcm") == 2

            settle(reloaded)
    for _ in range(3):
        new = server.request("POST", "/v1/encrypt/sm4-gcm", {"plaintext": PLAINTEXT}).json()
        assert new["key_version"] == 2
    server.request("POST", "/v1/decrypt/sm4-gcm", {"ciphertext": old["ciphertext"]})
    server.request("POST", "/v1/rewrap/sm4-gcm", {"ciphertext": old["ciphertext"]})
    settle_everywhere(server, "sm4-gcm", lambda u: u[1]["total"] == 3 and u[2]["total"] == 4)
    usage = versions(server, "sm4-gcm")
    assert {v: u["operations"]["encrypt"] for v, u in usage.items()} == {1: 1, 2: 3}
    assert usage[1]["operations"]["decrypt"] == 1
    assert usage[1]["operations"]["rewrap_from"] == 1
    assert usage[2]["operations"]["rewrap_to"] == 1
    assert usage[2]["operations"]["rewrap_from"] == 0
    # The light client reads the same.
    secret = base64.b64encode(server.secret).decode()
    with CryptdClient(server.url, server.client_id, secret) as light:
        described = light.get_key("sm4-gcm")
    seen = {v.version: v.usage for v in described.versions}
    assert seen[2] is not None
    assert seen[2].operations["encrypt"] == 3
    assert seen[2].total == 4
    assert seen[1] is not None
    assert seen[1].last_used_at is not None


def test_a_key_created_again_under_a_deleted_name_starts_from_zero(two_workers: Server) -> None:
    server = two_workers
    created = server.request(
        "POST", "/v1/keys/usage-again", {"type": "aes256-gcm", "deletion_allowed": True}
    )
    assert created.status_code == 201, created.text
    for _ in range(4):
        server.request("POST", "/v1/encrypt/usage-again", {"plaintext": PLAINTEXT})
    settle(lambda: versions(server, "usage-again")[1]["total"] == 4)
    assert server.request("DELETE", "/v1/keys/usage-again").status_code == 204
    time.sleep(1.2)  # the second worker sees the change (reload interval)
    again = server.request("POST", "/v1/keys/usage-again", {"type": "aes256-gcm"})
    assert again.status_code == 201, again.text
    # Same name, a later created_at (second resolution): a new key.
    if again.json()["created_at"] == created.json()["created_at"]:
        pytest.skip("deleted and created again within one second")
    settle(lambda: versions(server, "usage-again")[1]["total"] == 0)
    for _ in range(4):
        assert versions(server, "usage-again")[1]["total"] == 0


def test_counts_survive_a_restart_flushed_at_shutdown(tmp_path: Path) -> None:
    # An interval far beyond the test: only the shutdown flush can store the counts.
    slow = {"CRYPTD_USAGE_FLUSH_INTERVAL": "3600"}
    server = start_server(tmp_path, slow, workers=2)
    try:
        with connections_to_every_worker(server, 2) as clients:
            for n in range(10):
                send(clients[n % 2], server, "encrypt", "aes256-gcm", {"plaintext": PLAINTEXT})
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    # `cryptd keys usage` reads the store directly (the server is down).
    dev = tmp_path / "dev"
    report = subprocess.run(
        [sys.executable, "-m", "service", "keys", "usage", "aes256-gcm"],
        env={
            **os.environ,
            "CRYPTD_MASTER_KEY_FILE": str(dev / "master.key"),
            "CRYPTD_KEYRING_FILE": str(dev / "keyring.json"),
        },
        capture_output=True,
        check=True,
    )
    shown = orjson.loads(report.stdout)
    assert shown["keys"][0]["name"] == "aes256-gcm"
    assert shown["keys"][0]["versions"][0]["operations"]["encrypt"] == 10
    assert shown["store"] == f"file {dev / 'keyring.usage.sqlite'}"
    server = start_server(tmp_path, slow, workers=2)
    try:
        for _ in range(4):
            assert versions(server, "aes256-gcm")[1]["operations"]["encrypt"] == 10
    finally:
        stop_server(server)


def test_the_key_label_cap_folds_later_keys_into_other(tmp_path: Path) -> None:
    server = start_server(tmp_path, {**FAST, "CRYPTD_METRICS_MAX_KEYS": "2"}, workers=2)
    keys = ["aes256-gcm", "sm4-gcm", "hmac-sha256", "hmac-sha512", "ed25519"]
    try:
        with connections_to_every_worker(server, 2) as clients:
            # Each worker sees the keys in another order: the cap still holds for the host.
            for worker, order in ((0, keys), (1, list(reversed(keys)))):
                for key in order:
                    op, body = (
                        ("hmac", {"message": PLAINTEXT})
                        if key.startswith("hmac")
                        else ("sign", {"message": PLAINTEXT})
                        if key == "ed25519"
                        else ("encrypt", {"plaintext": PLAINTEXT})
                    )
                    send(clients[worker], server, op, key, body)
                    time.sleep(0.25)  # one flush per key: the first-counted order is known

        def samples() -> dict[str, float]:
            return metric(server, "cryptd_key_operations_total")

        wait_for(lambda: sum(samples().values()) == 10, timeout=10, what="every count")
        labelled = {re.search(r'key="([^"]*)"', s).group(1) for s in samples()}  # type: ignore[union-attr]
        assert len(labelled - {"_other"}) == 2
        assert "_other" in labelled
        other = {s: v for s, v in samples().items() if 'key="_other"' in s}
        assert all('version="_other"' in s for s in other)
        # The API's counts are never capped.
        settle(lambda: sum(versions(server, k)[1]["total"] for k in keys) == 10)
    finally:
        stop_server(server)


def test_two_replicas_on_postgresql_count_into_one_total(
    tmp_path: Path, pg_database: str, redis_url: str
) -> None:
    settings = {**FAST, "CRYPTD_REDIS_URL": redis_url}
    with replicas(tmp_path, pg_database, count=2, workers=2, env=settings) as servers:
        per_server = 40
        with (
            connections_to_every_worker(servers[0], 2) as first,
            connections_to_every_worker(servers[1], 2) as second,
        ):
            for n in range(per_server):
                for server, clients in ((servers[0], first), (servers[1], second)):
                    send(clients[n % 2], server, "encrypt", "aes256-gcm", {"plaintext": PLAINTEXT})
        settle(lambda: versions(servers[0], "aes256-gcm")[1]["total"] == 2 * per_server)
        for server in servers:
            usage = versions(server, "aes256-gcm")[1]
            assert usage["operations"]["encrypt"] == 2 * per_server
        with psycopg.connect(pg_database) as conn:
            stored = conn.execute(
                "SELECT sum(count) FROM cryptd_key_usage WHERE name = 'aes256-gcm' "
                "AND operation = 'encrypt'"
            ).fetchone()
        assert stored is not None
        assert stored[0] == 2 * per_server
        # Row writes: one per flush and row, far fewer than the 80 requests.
        total_flushes = sum(flushes(server) for server in servers)
        assert 0 < total_flushes < per_server

        def row_writes() -> int:
            with psycopg.connect(pg_database) as conn:
                row = conn.execute(
                    "SELECT coalesce(n_tup_ins + n_tup_upd, 0) FROM pg_stat_user_tables "
                    "WHERE relname = 'cryptd_key_usage'"
                ).fetchone()
            return int(row[0]) if row else 0

        wait_for(lambda: row_writes() > 0, timeout=10, what="the table statistics")
        assert row_writes() <= total_flushes + len(servers) * 2


def test_a_usage_store_that_cannot_be_written_refuses_nothing(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = {**FAST, "CRYPTD_USAGE_FILE": str(blocked / "usage.sqlite")}
    server = start_server(tmp_path / "server", env, workers=2)
    try:
        # Each worker knows only its own flushes: every worker gets requests, and every
        # worker's readiness is read (a worker with nothing to flush has failed nothing).
        with connections_to_every_worker(server, 2) as clients:
            for n in range(6):
                send(clients[n % 2], server, "encrypt", "aes256-gcm", {"plaintext": PLAINTEXT})
            for client in clients.values():

                def usage_check(c: httpx.Client = client) -> Any:
                    return c.get("/readyz").json()["checks"]["usage"]

                settle(lambda: not usage_check()["stored"])
                ready = client.get("/readyz")
                assert ready.status_code == 200
                assert ready.json()["status"] == "ready"
                assert usage_check() == {"ok": True, "backend": "sqlite", "stored": False}
                assert worker_versions(client, server, "aes256-gcm")[1] is None  # not zero
        failed = metric(server, "cryptd_usage_flushes_total").get('{outcome="error"}', 0)
        assert failed >= 1
        # The counts still reach the metric, and the error is logged once per outage.
        wait_for(
            lambda: sum(metric(server, "cryptd_key_operations_total").values()) == 6,
            timeout=10,
            what="the metric",
        )
        assert server.log().count("usage counts not stored") <= 2  # one per worker
    finally:
        stop_server(server)
    assert server.process.returncode == 0


def test_operations_run_in_pool_processes_and_threads_are_counted(tmp_path: Path) -> None:
    executors = orjson.dumps({"aes256-gcm": "process", "ed25519": "thread"}).decode()
    server = start_server(tmp_path, {**FAST, "CRYPTD_EXECUTORS": executors}, workers=1)
    try:
        for _ in range(3):
            answer = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": PLAINTEXT})
            assert answer.status_code == 200
        batch = {"batch": [{"plaintext": PLAINTEXT}] * 70}  # two chunks of the pool
        assert server.request("POST", "/v1/encrypt/aes256-gcm", batch).status_code == 200
        signed = server.request("POST", "/v1/sign/ed25519", {"message": PLAINTEXT})
        assert signed.status_code == 200
        time.sleep(0.6)
        assert versions(server, "aes256-gcm")[1]["operations"]["encrypt"] == 73
        assert versions(server, "ed25519")[1]["operations"]["sign"] == 1
    finally:
        stop_server(server)
