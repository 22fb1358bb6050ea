"""A replica cut off from the shared key store never serves a key that another replica
disabled meanwhile, from outside: two real servers (two workers each) on one PostgreSQL
database, the second reaching it through a relay the test cuts, Redis still reachable by
both (a partition from the key store alone, the case a host's store check cannot see).

The disabling replica's answer waits until the cut-off one is no longer live; by then every
worker of the cut-off one has let its lease run out and refuses keys (503 with Retry-After),
and once the link is back it reads the store before it serves again: the key is refused as
disabled (409), never encrypted with."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from service.keys.lease import LEASE
from service.keys.propagation import LIVE
from tests.conftest import Server
from tests.tcp_relay import Relay
from tests.test_keystore_replicas import encrypt
from tests.test_keystore_support import replicas, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def relay() -> Iterator[Relay]:
    found = Relay(5432)
    yield found
    found.close()


def status(server: Server) -> tuple[int, str]:
    """What encrypting with the test's key answers: the status and the error code."""
    response = encrypt(server, "aes256-gcm")
    return response.status_code, "" if response.is_success else response.json()["error"]["code"]


def test_a_replica_cut_off_from_the_store_never_serves_a_key_disabled_meanwhile(
    tmp_path: object, pg_database: str, redis_url: str, relay: Relay
) -> None:
    through_relay = pg_database.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
    env = {"CRYPTD_REDIS_URL": redis_url}
    with replicas(tmp_path, [pg_database, through_relay], env=env) as (a, b):  # type: ignore[arg-type]
        assert status(b) == (200, "")
        # /readyz answers once one worker is up: the cut must not come while b's other worker
        # is still loading the keyring (a worker that cannot start stops the server).
        wait_for(
            lambda: b.log().count("Application startup complete.") >= 2, what="b's every worker"
        )
        answers: list[tuple[float, int, str]] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                answers.append((sent, *status(b)))
                time.sleep(0.01)

        loader = threading.Thread(target=load)
        loader.start()
        try:
            relay.cut()
            cut = time.monotonic()
            disabled = a.request("PATCH", "/v1/keys/aes256-gcm", {"state": "disabled"})
            answered = time.monotonic()
            assert disabled.status_code == 200, disabled.text
            # Waited until b was no longer live (no word from it for LIVE seconds): b's last
            # announcement came at most a heartbeat before the cut.
            assert answered - cut > LIVE - 2.5, disabled.headers.get("x-cryptd-propagation")
            wait_for(lambda: any(sent > answered + 1 for sent, _, _ in answers), what="load")
            relay.restore()
            wait_for(lambda: status(b) == (409, "key_disabled"), timeout=20, what="b's return")
            back = time.monotonic()
            wait_for(lambda: any(sent > back + 1 for sent, _, _ in answers), what="load")
        finally:
            stop.set()
            loader.join()
        after = [(code, error) for sent, code, error in answers if sent > answered]
        assert after
        assert (200, "") not in after, "b served the key after its disabling was answered"
        assert set(after) <= {(503, "keystore_unavailable"), (409, "key_disabled")}
        # It kept serving while its lease held, and stopped before the answer.
        served = [sent for sent, code, _ in answers if code == 200]
        assert max(served) > cut
        assert max(served) < cut + LEASE
