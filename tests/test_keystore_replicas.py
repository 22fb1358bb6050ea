"""Replicas sharing a PostgreSQL key store, from outside: real server processes (two workers
each) on one database of the test's own. A key created on one replica is served by the other
at once, concurrent rotations on both lose nothing, a change reaches every worker through the
notifications alone, and a database that goes away leaves crypto serving for the workers'
leases (then 503) while management answers 503 until it is back."""

from __future__ import annotations

import base64
import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from pathlib import Path

import httpx
import pytest

from service.keys.propagation import LIVE
from tests.conftest import Server
from tests.test_keystore_support import b64, private_postgres, replicas, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def pair(tmp_path: Path, pg_database: str, redis_url: str) -> Iterator[list[Server]]:
    with replicas(tmp_path, pg_database, env={"CRYPTD_REDIS_URL": redis_url}) as servers:
        yield servers


def encrypt(server: Server, key: str, text: bytes = b"x", **extra: object) -> httpx.Response:
    return server.request("POST", f"/v1/encrypt/{key}", {"plaintext": b64(text), **extra})


def decrypt(server: Server, key: str, token: str) -> httpx.Response:
    return server.request("POST", f"/v1/decrypt/{key}", {"ciphertext": token})


def test_a_key_created_on_one_replica_is_served_by_the_other_at_once(
    pair: list[Server],
) -> None:
    a, b = pair
    for index in range(12):
        writer, reader = (a, b) if index % 2 == 0 else (b, a)
        name = f"fresh-{index}"
        created = writer.request("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"})
        assert created.status_code == 201, created.text
        # At once, on whichever worker of the other replica takes the connection.
        response = encrypt(reader, name, b"hello")
        assert response.status_code == 200, response.text
        assert (
            base64.b64decode(
                decrypt(writer, name, response.json()["ciphertext"]).json()["plaintext"]
            )
            == b"hello"
        )
        assert reader.request("GET", f"/v1/keys/{name}").status_code == 200
        # A new version made on one replica: a token under it opens on the other at once.
        rotated = writer.request("POST", f"/v1/keys/{name}/rotate")
        assert rotated.status_code == 200
        # (The writer's other worker may still encrypt under version 1 for the moment its
        # notification takes; naming the version makes any worker look.)
        token = encrypt(writer, name, key_version=2).json()["ciphertext"]
        assert token.startswith("cryptd:v2:")
        assert decrypt(reader, name, token).status_code == 200
        explicit = encrypt(reader, name, key_version=2)
        assert explicit.status_code == 200, explicit.text
    # A key that exists nowhere is still 404.
    missing = encrypt(a, "never-created")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "key_not_found"


def test_concurrent_rotations_on_both_replicas_lose_no_version(pair: list[Server]) -> None:
    a, b = pair
    assert a.request("POST", "/v1/keys/spin", {"type": "aes256-gcm"}).status_code == 201
    per_thread, threads_per_replica = 3, 2
    versions: list[int] = []
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    start = threading.Barrier(2 * threads_per_replica)

    def rotate(server: Server) -> None:
        start.wait()
        for _ in range(per_thread):
            response = server.request("POST", "/v1/keys/spin/rotate")
            with lock:
                statuses[response.status_code] += 1
                if response.status_code == 200:
                    versions.append(response.json()["latest_version"])

    threads = [
        threading.Thread(target=rotate, args=(server,))
        for server in (a, b)
        for _ in range(threads_per_replica)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = 2 * threads_per_replica * per_thread
    assert statuses == {200: total}
    assert sorted(versions) == list(range(2, total + 2)), "two rotations got the same version"
    for server in (a, b):
        described = server.request("GET", "/v1/keys/spin").json()
        assert [v["version"] for v in described["versions"]] == list(range(1, total + 2))


def test_a_change_reaches_every_worker_through_notifications(
    tmp_path: Path, pg_database: str, redis_url: str
) -> None:
    """The periodic check is off (one hour): only the notification can bring the rotation to
    the other replica's workers, and nothing makes them look (the key is known)."""
    env = {"CRYPTD_REDIS_URL": redis_url, "CRYPTD_KEYRING_RELOAD_INTERVAL": "3600"}
    with replicas(tmp_path, pg_database, env=env) as (a, b):
        assert encrypt(b, "aes256-gcm").json()["key_version"] == 1
        assert a.request("POST", "/v1/keys/aes256-gcm/rotate").status_code == 200
        rotated_at = time.monotonic()
        streak = 0
        while streak < 20:  # 20 fresh connections in a row: both workers have it
            assert time.monotonic() - rotated_at < 10, "a worker never saw the rotation"
            streak = streak + 1 if encrypt(b, "aes256-gcm").json()["key_version"] == 2 else 0


def refusing_keys(server: Server) -> bool:
    """/readyz, from whichever worker answers: not ready, its lease on the keyring ran out."""
    ready = server.request("GET", "/readyz")
    reasons = " ".join(ready.json()["reasons"])
    return ready.status_code == 503 and "keyring: the key store has not been reached" in reasons


def test_postgres_stopped_under_load(tmp_path: Path, redis_url: str) -> None:
    """A private cluster (never the shared one) is stopped while both replicas serve crypto:
    crypto goes on from memory while the workers' leases hold (a few seconds), then answers
    503 keystore_unavailable with Retry-After (a change made meanwhile could not be known)
    and /readyz says not ready; management answers 503 throughout; once the database is back,
    everything recovers by itself. Never another status."""
    with (
        private_postgres() as cluster,
        replicas(tmp_path, cluster.url, env={"CRYPTD_REDIS_URL": redis_url}) as (a, b),
    ):
        token = encrypt(a, "sm4-gcm", b"steady").json()["ciphertext"]
        stop = threading.Event()
        # sent, status, code, Retry-After, answered
        answers: list[tuple[float, int, str, str | None, float]] = []
        lock = threading.Lock()

        def load(server: Server) -> None:
            while not stop.is_set():
                for call in (
                    partial(encrypt, server, "aes256-gcm"),
                    partial(decrypt, server, "sm4-gcm", token),
                ):
                    sent = time.monotonic()
                    response = call()
                    code = "" if response.status_code == 200 else response.json()["error"]["code"]
                    with lock:
                        retry = response.headers.get("retry-after")
                        answers.append((sent, response.status_code, code, retry, time.monotonic()))

        workers = [threading.Thread(target=load, args=(s,)) for s in (a, b) for _ in range(2)]
        for worker in workers:
            worker.start()
        try:
            wait_for(lambda: len(answers) > 50, what="load to start")
            cluster.stop()
            stopped = time.monotonic()
            for server in (a, b):
                refused = server.request("POST", "/v1/keys/during", {"type": "aes256-gcm"})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "keystore_unavailable"
                assert refused.headers["retry-after"]
                rotate = server.request("POST", "/v1/keys/aes256-gcm/rotate")
                assert rotate.status_code == 503
            for server in (a, b):
                wait_for(partial(refusing_keys, server), timeout=20, what="the lease to run out")
            # Every worker's lease has run out by then (it ran from an announcement before
            # the stop); the load goes on a moment more against them all.
            time.sleep(max(0.0, stopped + LIVE + 1.5 - time.monotonic()))
            restarting = time.monotonic()
            cluster.start()
            for server in (a, b):

                def ready(server: Server = server) -> bool:
                    return bool(server.request("GET", "/readyz").json()["status"] == "ready")

                wait_for(ready, timeout=30, what="recovery")
            recovered = time.monotonic()
            created = a.request("POST", "/v1/keys/after", {"type": "aes256-gcm"})
            assert created.status_code == 201, created.text
            assert encrypt(b, "after").status_code == 200
            wait_for(lambda: answers[-1][0] > recovered + 1, what="load after the recovery")
        finally:
            stop.set()
            for worker in workers:
                worker.join()
        assert {status for _, status, _, _, _ in answers} <= {200, 503}
        refusals = [(code, retry) for _, status, code, retry, _ in answers if status == 503]
        assert refusals, "crypto never stopped while the store was down"
        assert {code for code, _ in refusals} == {"keystore_unavailable"}
        assert all(retry for _, retry in refusals), "a 503 without Retry-After"
        served_on = [sent for sent, status, _, _, _ in answers if status == 200 and sent > stopped]
        assert served_on, "crypto stopped with the store at once"
        assert min(served_on) < stopped + 1
        # The lease ends by a timer, which a busy event loop runs late: the guarantee is that
        # no key is served once the others forget the host (LIVE, a second after the lease).
        # Answered before the restart: a request may wait for the lease to be regained (up to
        # a second) and be served once the database is back, as it should.
        after_leases = [
            s
            for sent, s, _, _, answered in answers
            if stopped + LIVE < sent and answered < restarting
        ]
        assert after_leases
        assert set(after_leases) == {503}, "a key served after every lease ran out"
        assert all(status == 200 for sent, status, _, _, _ in answers if sent > recovered + 0.5)
        assert b.request("GET", "/v1/keys/during").status_code == 404  # nothing half-written


def test_automatic_rotation_happens_once_per_period_across_replicas(
    tmp_path: Path, pg_database: str, redis_url: str
) -> None:
    """Four workers of two replicas look every half second; each due rotation is done by one
    of them only: consecutive versions are a period apart, never two at once."""
    period = 3
    env = {"CRYPTD_REDIS_URL": redis_url, "CRYPTD_AUTO_ROTATE_CHECK_INTERVAL": "0.5"}
    with replicas(tmp_path, pg_database, env=env) as (a, b):
        created = a.request(
            "POST", "/v1/keys/auto", {"type": "aes256-gcm", "auto_rotate_period": period}
        )
        assert created.status_code == 201
        assert created.json()["auto_rotate_period"] == period
        time.sleep(3.5 * period)
        described = b.request("GET", "/v1/keys/auto").json()
        stamps = [
            datetime.strptime(v["created_at"], "%Y-%m-%dT%H:%M:%SZ").timestamp()
            for v in described["versions"]
        ]
        assert 3 <= len(stamps) <= 5, described["versions"]
        gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
        # created_at has whole seconds: a gap is the period give or take one second.
        assert all(gap >= period - 1 for gap in gaps), gaps
        # Turned off with PATCH, on the other replica: no more versions.
        patched = b.request("PATCH", "/v1/keys/auto", {"auto_rotate_period": 0})
        assert patched.status_code == 200
        assert patched.json()["auto_rotate_period"] == 0
        latest = patched.json()["latest_version"]
        time.sleep(2 * period)
        assert a.request("GET", "/v1/keys/auto").json()["latest_version"] == latest
