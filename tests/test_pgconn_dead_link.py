"""A PostgreSQL store whose network path dies without a word (a link down, a host cut off,
a firewall dropping packets: no RST, no FIN) fails its statement within seconds instead of
hanging its request, and the worker's store lock, for TCP's retransmission limit (~15 min).

The path is cut for real: the store talks to the database through a relay on a port of its
own, and iptables drops that port's packets, so what the store sent is never acknowledged.
Needs root and iptables (under CI both are there: a skip there is a failure)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from service.errors import KeystoreUnavailable
from service.keys.admin import initialise
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.pgstore import PostgresKeyStore
from service.keys.store import StoreUnavailable
from service.keys.watch import REGAIN_WAIT, KeyringWatcher
from service.pgconn import DEFAULTS
from tests.tcp_relay import Relay
from tests.test_keystore_support import needs_root, needs_tool

pytestmark = pytest.mark.slow


def _rules(port: int) -> list[list[str]]:
    return [
        ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
        ["OUTPUT", "-o", "lo", "-p", "tcp", "--sport", str(port), "-j", "DROP"],
    ]


@contextlib.contextmanager
def _link_cut(port: int) -> Iterator[None]:
    for rule in _rules(port):
        subprocess.run(["iptables", "-I", *rule], check=True)
    try:
        yield
    finally:
        for rule in _rules(port):
            subprocess.run(["iptables", "-D", *rule], check=False)


@pytest.fixture
def relay() -> Iterator[Relay]:
    needs_root("cutting a link with iptables")
    needs_tool("iptables")
    found = Relay(5432)
    yield found
    found.close()


def test_a_statement_on_a_dead_link_fails_within_seconds_and_the_store_recovers(
    pg_database: str, relay: Relay
) -> None:
    url = pg_database.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
    store = PostgresKeyStore(url)
    store.create_schema()
    assert store.stamp() is None  # through the relay, no keyring yet

    # What bounds the wait: unacknowledged data for tcp_user_timeout, then the error.
    bound = int(DEFAULTS["tcp_user_timeout"]) / 1000
    with _link_cut(relay.port):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.stamp()
        waited = time.monotonic() - started
    assert bound - 1 <= waited <= bound + 5, waited

    # The broken connection was dropped: the next statement opens a new one and succeeds.
    assert store.stamp() is None
    store.close()


def test_a_statement_waiting_for_its_answer_when_the_link_dies_fails_within_seconds(
    pg_database: str, relay: Relay
) -> None:
    """Everything sent was acknowledged before the cut: only the keepalives can tell the
    answer will never come (idle, then probes that go unanswered past tcp_user_timeout)."""
    url = pg_database.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
    store = PostgresKeyStore(url)
    store.create_schema()
    outcome: dict[str, object] = {}

    def long_statement() -> None:
        try:
            with store._session() as conn:
                conn.execute("SELECT pg_sleep(60)")
            outcome["error"] = None
        except StoreUnavailable as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=long_statement, daemon=True)
    thread.start()
    time.sleep(1)  # the statement is on the server, acknowledged
    with _link_cut(relay.port):
        cut = time.monotonic()
        thread.join(30)
    assert not thread.is_alive(), "still waiting 30 s after the link died"
    assert isinstance(outcome["error"], StoreUnavailable), outcome
    idle = int(DEFAULTS["keepalives_idle"])
    assert idle <= float(outcome["at"]) - cut <= 15  # type: ignore[arg-type]
    assert store.stamp() is None  # a new connection once the link is back
    store.close()


async def test_a_worker_whose_lease_ran_out_on_a_dead_link_answers_within_a_moment(
    pg_database: str, relay: Relay
) -> None:
    """Over a dead link the attempt to regain the lease hangs for the connection's timeouts;
    requests do not wait for it longer than REGAIN_WAIT: 503 keystore_unavailable."""
    master = MasterKey(os.urandom(32))
    url = pg_database.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
    store = PostgresKeyStore(url)
    initialise(store, master)
    manager = KeyManager(store, master)
    manager.load()
    watcher = KeyringWatcher(manager, interval=3600, heartbeat=0.2, lease=1.0)
    watcher.start()
    try:
        await watcher.current()  # regains the lease (announce, then read the store)
        assert serving(watcher)
        with _link_cut(relay.port):
            await asyncio.sleep(1.5)  # the heartbeats hang: the lease runs out
            assert not serving(watcher)
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(KeystoreUnavailable, match="has not been reached in time"):
                    await watcher.current()
                assert time.monotonic() - started < REGAIN_WAIT + 0.5
        # The link is back: the next attempts get through (reconnecting) and keys serve again.
        deadline = time.monotonic() + 30
        while not serving(watcher):
            assert time.monotonic() < deadline, "the lease never came back"
            with contextlib.suppress(KeystoreUnavailable):
                await watcher.current()
            await asyncio.sleep(0.1)
        assert (await watcher.current()).generation == manager.keyring.generation
    finally:
        await watcher.close()
        store.close()


def serving(watcher: KeyringWatcher) -> bool:
    return watcher.lease.held  # read anew each time (a timer turns it off)
