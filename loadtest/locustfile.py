"""Locust load test for cryptd, built on the project's signing client (cryptd_client).

    cryptd serve --dev &                      # writes .cryptd-dev/client.json
    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 30s --tags rsa-sign rsa-decrypt

The credential comes from ``CRYPTD_CREDENTIALS`` (default ``.cryptd-dev/client.json``); ``--host``
overrides its URL. One task per scenario of loadtest/scenarios.py, tagged with the scenario
name; every request is signed by :class:`cryptd_client.CryptdClient` with a fresh nonce. The
client's retries are off so 429/503 show up as failures instead of hiding in retries.

Locust's Python users are expensive per request (gevent, httpx): use it for mixed workloads
and behaviour over time, and wrk (loadtest/wrk) or ``python -m loadtest.run`` for peak figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from locust import User, constant, tag, task

from cryptd_client import CryptdAPIError, CryptdClient

# The sizes and filler of loadtest/scenarios.py, repeated because locust puts this file's
# directory on sys.path, not the repository root (tests check that they agree).
BATCH_ITEMS = 100


def payload(size: int) -> bytes:
    return bytes(((i + 1) * 131 + 7) % 256 for i in range(size))


PLAINTEXT = payload(1024)
MESSAGE = payload(32)
SECRET = payload(32)


def credentials_path() -> Path:
    return Path(os.environ.get("CRYPTD_CREDENTIALS", ".cryptd-dev/client.json"))


class CryptdUser(User):
    """Closed loop: each simulated user sends its next request as soon as one is answered."""

    wait_time = constant(0)

    def on_start(self) -> None:
        credential: dict[str, str] = orjson.loads(credentials_path().read_bytes())
        client = CryptdClient(
            self.host or credential["url"],
            credential["client_id"],
            credential["secret"],
            retries=0,
            timeout=30.0,
        )
        self.cryptd = client
        # Ciphertexts for the decrypt tasks, made once per user (not measured).
        self.aes_token = client.encrypt("aes256-gcm", PLAINTEXT).ciphertext
        self.rsa_token = client.encrypt("rsa-2048", SECRET).ciphertext

    def on_stop(self) -> None:
        self.cryptd.close()

    def _measure(self, name: str, call: Callable[[], object]) -> None:
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            call()
        except Exception as exc:  # API errors, connection errors: a failed request
            error = exc
        self.environment.events.request.fire(
            request_type="POST",
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=0,
            exception=error,
            context={},
        )

    @tag("aes-encrypt")
    @task
    def aes_encrypt(self) -> None:
        self._measure("aes-encrypt", lambda: self.cryptd.encrypt("aes256-gcm", PLAINTEXT))

    @tag("aes-decrypt")
    @task
    def aes_decrypt(self) -> None:
        self._measure("aes-decrypt", lambda: self.cryptd.decrypt("aes256-gcm", self.aes_token))

    @tag("rsa-sign")
    @task
    def rsa_sign(self) -> None:
        self._measure("rsa-sign", lambda: self.cryptd.sign("rsa-2048", MESSAGE, algorithm="pss"))

    @tag("rsa-decrypt")
    @task
    def rsa_decrypt(self) -> None:
        self._measure("rsa-decrypt", lambda: self.cryptd.decrypt("rsa-2048", self.rsa_token))

    @tag("ecdsa-sign")
    @task
    def ecdsa_sign(self) -> None:
        self._measure("ecdsa-sign", lambda: self.cryptd.sign("ecdsa-p256", MESSAGE))

    @tag("ed25519-sign")
    @task
    def ed25519_sign(self) -> None:
        self._measure("ed25519-sign", lambda: self.cryptd.sign("ed25519", MESSAGE))

    @tag("sm2-sign")
    @task
    def sm2_sign(self) -> None:
        self._measure("sm2-sign", lambda: self.cryptd.sign("sm2", MESSAGE))

    @tag("aes-batch")
    @task
    def aes_batch(self) -> None:
        def batch() -> None:
            results = self.cryptd.encrypt_batch("aes256-gcm", [PLAINTEXT] * BATCH_ITEMS)
            failed = [r for r in results if isinstance(r, CryptdAPIError)]
            if failed:
                raise failed[0]

        self._measure("aes-batch", batch)
