"""A PostgreSQL store whose network path dies without a word (a link down, a host cut off,
a firewall dropping packets: no RST, no FIN) fails its statement within seconds instead of
hanging its request, and the worker's store lock, for TCP's retransmission limit (~15 min).

The path is cut for real: the store talks to the database through a relay on a port of its
own, and iptables drops that port's packets, so what the store sent is never acknowledged.
Needs root and iptables (under CI both are there: a skip there is a failure)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from service.keys.pgstore import PostgresKeyStore
from service.keys.store import StoreUnavailable
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
