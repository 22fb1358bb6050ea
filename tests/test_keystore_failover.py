"""The PostgreSQL key store while it fails over, from outside (real servers, private
clusters): a key the store cannot be asked about is never answered 404, every 503 carries
Retry-After, and a hot standby promoted after the primary is killed serves every key change
acknowledged under synchronous replication, with nobody restarting cryptd."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from service.keys.lease import LEASE
from tests.conftest import Server, free_port
from tests.test_keystore_support import (
    PG_BIN,
    PrivatePostgres,
    _as_postgres,
    b64,
    private_postgres,
    replicas,
    wait_for,
)

pytestmark = pytest.mark.slow


def _encrypt(server: Server, key: str, **extra: object) -> httpx.Response:
    return server.request("POST", f"/v1/encrypt/{key}", {"plaintext": b64(b"x"), **extra})


def _assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "keystore_unavailable"
    assert response.headers["retry-after"].isdigit()


class Standby(PrivatePostgres):
    """A streaming hot standby of ``primary`` (``pg_basebackup -R``)."""

    def __init__(self, primary: PrivatePostgres) -> None:
        directory = Path(tempfile.mkdtemp(prefix="cryptd-pg-standby-"))
        if os.geteuid() == 0:
            shutil.chown(directory, "postgres", "postgres")
        super().__init__(directory, free_port())
        subprocess.run(
            [
                *_as_postgres(),
                str(PG_BIN / "pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                "postgres",
                "-D",
                str(directory / "data"),
                "-R",  # standby.signal and primary_conninfo
                "-X",
                "stream",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        # primary_conninfo from -R names the primary; the standby identifies itself.
        conf = directory / "data" / "postgresql.auto.conf"
        conf.write_text(
            conf.read_text().replace(
                "primary_conninfo = '", "primary_conninfo = 'application_name=standby "
            )
        )

    def promote(self) -> None:
        self._pg_ctl("-w", "promote")

    def kill(self) -> None:
        self._pg_ctl("-m", "immediate", "-w", "stop")


@pytest.fixture
def primary_and_standby() -> Iterator[tuple[PrivatePostgres, Standby]]:
    with private_postgres() as primary:
        standby = Standby(primary)
        try:
            standby.start()
            with psycopg.connect(primary.url, autocommit=True) as conn:
                wait_for(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                        ).fetchone()
                        == (1,)
                    ),
                    what="the standby to stream",
                )
                # The documented settings (docs/SCALE.md): a commit returns once the standby
                # has it too.
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (standby)'")
                conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
                conn.execute("SELECT pg_reload_conf()")
                wait_for(
                    lambda: (
                        conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
                        == ("sync",)
                    ),
                    what="synchronous replication",
                )
            yield primary, standby
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                standby.stop()
            shutil.rmtree(standby.directory, ignore_errors=True)


def test_promoted_standby_keeps_every_acknowledged_change(
    tmp_path: Path, redis_url: str, primary_and_standby: tuple[PrivatePostgres, Standby]
) -> None:
    primary, standby = primary_and_standby
    url = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
        "?target_session_attrs=read-write&connect_timeout=2"
    )
    with replicas(tmp_path, url, env={"CRYPTD_REDIS_URL": redis_url}) as (a, b):
        names = [f"acked-{i}" for i in range(5)]
        for name in names:
            assert a.request("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"}).status_code == 201
        assert a.request("POST", f"/v1/keys/{names[0]}/rotate").status_code == 200
        stop = threading.Event()
        outcomes: Counter[int] = Counter()
        retry_after_missing = 0

        def load(server: Server) -> None:
            nonlocal retry_after_missing
            index = 0
            while not stop.is_set():
                index += 1
                for response in (
                    _encrypt(server, names[index % len(names)]),
                    server.request("GET", f"/v1/keys/{names[index % len(names)]}"),
                ):
                    outcomes[response.status_code] += 1
                    if response.status_code == 503 and "retry-after" not in response.headers:
                        retry_after_missing += 1

        threads = [threading.Thread(target=load, args=(s,)) for s in (a, b)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: sum(outcomes.values()) > 40, what="load to start")
            assert a.request("GET", "/v1/keys/unknown").status_code == 404  # the store said so
            primary._pg_ctl("-m", "immediate", "-w", "stop")  # the primary's host is lost
            killed = time.monotonic()
            # Known keys keep serving from memory; a name or version this worker does not know
            # cannot be told apart from one created elsewhere just before: 503, never 404.
            _assert_unavailable(a.request("GET", "/v1/keys/unknown"))
            _assert_unavailable(_encrypt(b, "unknown"))
            _assert_unavailable(_encrypt(b, names[1], key_version=7))
            assert _encrypt(a, names[1]).status_code == 200
            _assert_unavailable(a.request("POST", "/v1/keys/in-between", {"type": "aes256-gcm"}))
            # Each worker finds the store gone on its own (a request, or its periodic look):
            # the one answering /readyz may not be the one that just failed.
            deadline = time.monotonic() + 15
            while True:
                ready = a.request("GET", "/readyz")
                assert ready.status_code == 200
                if ready.json()["status"] == "degraded" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert ready.json()["status"] == "degraded"
            assert any("key store" in reason for reason in ready.json()["reasons"])
            standby.promote()
            created = None
            while time.monotonic() - killed < 60:
                created = a.request("POST", "/v1/keys/after", {"type": "aes256-gcm"})
                if created.status_code != 503:
                    break
                assert created.headers["retry-after"].isdigit()
                time.sleep(0.2)
            assert created is not None
            assert created.status_code == 201, created.text
            window = time.monotonic() - killed
            print(f"\nkey management refused for {window:.1f} s from the primary's loss")
            during = sum(outcomes.values())
            wait_for(lambda: sum(outcomes.values()) > during + 20, what="load after")
            assert a.request("GET", "/v1/keys/unknown").status_code == 404  # asked again
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        # Nothing acknowledged was lost: the rotation and every key are on the new primary.
        for server in (a, b):
            described = server.request("GET", f"/v1/keys/{names[0]}").json()
            assert described["latest_version"] == 2
            for name in names:
                assert _encrypt(server, name).status_code == 200
            assert _encrypt(server, "after").status_code == 200
        assert 404 not in outcomes, outcomes
        assert set(outcomes) <= {200, 503}, outcomes
        assert retry_after_missing == 0


def test_losing_the_synchronous_standby_never_stops_keys_being_served(
    tmp_path: Path, redis_url: str, primary_and_standby: tuple[PrivatePostgres, Standby]
) -> None:
    """With the standby gone, a commit waits for it (that is what synchronous replication
    promises), but announcements, which keep every worker's lease, are no key change: they
    must not wait for it, or losing one machine stops every replica serving. A change whose
    wait is cancelled (the statement timeout, 60 s; here at once, the same interrupt) is
    committed on the primary alone: never acknowledged."""
    primary, standby = primary_and_standby
    with replicas(tmp_path, primary.url, env={"CRYPTD_REDIS_URL": redis_url}) as (a, b):
        for server in (a, b):
            assert _encrypt(server, "aes256-gcm").status_code == 200
        standby.kill()  # the standby's host is lost
        outcomes: Counter[int] = Counter()
        until = time.monotonic() + LEASE + 3
        while time.monotonic() < until:
            for server in (a, b):
                outcomes[_encrypt(server, "aes256-gcm").status_code] += 1
            time.sleep(0.02)
        assert set(outcomes) == {200}, outcomes
        ready = a.request("GET", "/readyz")
        assert ready.status_code == 200, ready.text
        answer: list[httpx.Response] = []
        change = threading.Thread(
            target=lambda: answer.append(
                a.request("PATCH", "/v1/keys/sm4-gcm", {"state": "disabled"})
            )
        )
        change.start()
        with psycopg.connect(primary.url, autocommit=True) as conn:

            def waiting_for_standby() -> list[tuple[int]]:
                return conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
                ).fetchall()

            wait_for(lambda: bool(waiting_for_standby()), what="a commit waiting for the standby")
            time.sleep(0.5)
            assert not answer
            for (pid,) in waiting_for_standby():
                conn.execute("SELECT pg_cancel_backend(%s)", (pid,))
        change.join(timeout=20)
        assert answer, "the change was never answered"
        _assert_unavailable(answer[0])
        assert "not acknowledged" in answer[0].json()["error"]["message"]
        # Committed on the primary all the same: in force everywhere, as the answer said.
        wait_for(
            lambda: _encrypt(b, "sm4-gcm").json().get("error", {}).get("code") == "key_disabled",
            what="the unconfirmed change in force",
        )
        # Nor does the usage counters' last flush hold the shutdown (killed after 30 s).
        stopping = time.monotonic()
        a.process.terminate()
        assert a.process.wait(timeout=60) == 0
        assert time.monotonic() - stopping < 10
        assert "did not stop in time" not in a.log()
