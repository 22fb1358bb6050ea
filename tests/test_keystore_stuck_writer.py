"""A key change that cannot go ahead never stops keys being served, and a writer that froze
holding the store's row lock holds up the others for seconds, not hours: a real server and
real writer processes on a PostgreSQL database.

Each replica's writers queue on the header row's lock (``SELECT ... FOR UPDATE``, waiting up
to ``LOCK_TIMEOUT``, 30 s). A writer waiting there used to hold the store's one connection,
so its worker's announcements, which keep the worker's lease (5 s), waited behind it: the
worker let its lease run out and refused every key with 503 ``keystore_unavailable``. And a
writer whose host dropped off the network between two statements left its session, and the
lock, on the server until TCP keepalive gave up (two hours by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from service.keys.lease import LEASE
from service.keys.pgstore import IDLE_IN_TRANSACTION_TIMEOUT, PostgresKeyStore
from tests.test_keystore_replicas import encrypt
from tests.test_keystore_support import replicas

pytestmark = pytest.mark.slow  # a PostgreSQL database and a server for each test

IDLE_SECONDS = float(IDLE_IN_TRANSACTION_TIMEOUT.removesuffix("s"))


@pytest.fixture
def row_locked(pg_database: str) -> Iterator[psycopg.Connection[object]]:
    """Another replica's writer, taking its turn for ever: the header row locked until the
    test rolls back."""
    with psycopg.connect(pg_database) as holder:
        yield holder
        holder.rollback()


def test_a_key_change_waiting_longer_than_the_lease_never_stops_keys_being_served(
    tmp_path: Path, pg_database: str, redis_url: str, row_locked: psycopg.Connection[object]
) -> None:
    env = {"CRYPTD_REDIS_URL": redis_url}
    # One worker: the one whose key change waits is the one that must keep serving.
    with replicas(tmp_path, [pg_database], workers=1, env=env) as (server,):
        assert encrypt(server, "aes256-gcm").status_code == 200
        row_locked.execute("SELECT 1 FROM cryptd_keyring WHERE id = 1 FOR UPDATE")
        answer: list[httpx.Response] = []
        change = threading.Thread(
            target=lambda: answer.append(
                server.request("PATCH", "/v1/keys/sm4-gcm", {"state": "disabled"})
            )
        )
        change.start()
        try:
            time.sleep(0.5)
            assert not answer, "the change went ahead while the row was locked"
            statuses: dict[str, int] = {}
            until = time.monotonic() + LEASE + 3
            while time.monotonic() < until:
                response = encrypt(server, "aes256-gcm")
                status = "200" if response.is_success else response.text
                statuses[status] = statuses.get(status, 0) + 1
                time.sleep(0.02)
            assert not answer, "the change went ahead while the row was locked"
            # Every one served, through more than a lease's length of waiting change.
            assert set(statuses) == {"200"}, statuses
        finally:
            row_locked.rollback()
            change.join(timeout=20)
        assert answer, "the change was never answered"
        assert answer[0].status_code == 200, answer[0].text
        assert encrypt(server, "sm4-gcm").json()["error"]["code"] == "key_disabled"
        assert encrypt(server, "aes256-gcm").status_code == 200


_FROZEN_WRITER = """
import os, signal, sys
from service.keys.pgstore import PostgresKeyStore

store = PostgresKeyStore(sys.argv[1])
with store.transaction() as transaction:
    document = transaction.read()
    document["keys"].pop("aes256-gcm")
    transaction.write(document)
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as a host cut off would be to the server
"""


def test_a_writer_frozen_in_its_transaction_lets_the_others_through_within_seconds(
    tmp_path: Path, pg_database: str, redis_url: str
) -> None:
    env = {"CRYPTD_REDIS_URL": redis_url}
    with replicas(tmp_path, [pg_database], workers=1, env=env) as (server,):
        frozen = subprocess.Popen(
            [sys.executable, "-c", _FROZEN_WRITER, pg_database],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        try:
            assert frozen.stdout is not None
            assert frozen.stdout.readline().strip() == "locked"
            store = PostgresKeyStore(pg_database)
            started = time.monotonic()
            try:
                with store.transaction() as transaction:
                    waited = time.monotonic() - started
                    document = transaction.read()
            finally:
                store.close()
        finally:
            frozen.send_signal(signal.SIGKILL)
            frozen.communicate()
        # The server ended the frozen writer's session once it sat idle that long, well
        # before the 30 s this writer would wait; what it wrote was never committed.
        assert IDLE_SECONDS - 1 < waited < IDLE_SECONDS + 5, waited
        assert document is not None
        assert "aes256-gcm" in document["keys"]
        assert encrypt(server, "aes256-gcm").status_code == 200
