"""The replay store's start-up window, seen from outside: the epoch is set when the server
starts (before any request), /readyz is not ready and names the window (with Retry-After)
while it lasts, and once /readyz says ready a freshly signed request is accepted at once."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from service.auth.replay import KEY_PREFIX
from service.auth.signature import sign_request
from tests.conftest import free_port
from tests.test_redis_support import client, redis_server

pytestmark = pytest.mark.slow


def test_window_is_named_by_readyz_and_ready_means_accepted(tmp_path: Path) -> None:
    redis = redis_server(tmp_path / "redis", free_port())  # brand new: no epoch, never seen
    redis.start()
    port = free_port()
    env = {
        **os.environ,
        "CRYPTD_DEV_DIR": str(tmp_path / "dev"),
        "CRYPTD_WORKERS": "1",
        "CRYPTD_REDIS_URL": f"redis://127.0.0.1:{redis.port}/0",
        "CRYPTD_SIGNATURE_MAX_SKEW": "4",
    }
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--dev", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=5) as http:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, (tmp_path / "server.log").read_text()
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # Set by the server's start, not by a request or a readiness probe.
            epoch = client(redis.port).get(f"{KEY_PREFIX}epoch")
            assert epoch is not None
            assert int(epoch) <= int(time.time()) + 1

            credential = orjson.loads((tmp_path / "dev" / "client.json").read_bytes())
            secret = base64.b64decode(credential["secret"])
            ready = http.get("/readyz")
            assert ready.status_code == 503
            body = ready.json()
            assert body["status"] == "not_ready"
            assert any(
                "replay store" in reason and "epoch" in reason for reason in body["reasons"]
            ), body
            assert 1 <= int(ready.headers["retry-after"]) <= 6
            refused = http.get("/v1/keys", headers=_signed(credential["client_id"], secret))
            assert refused.status_code == 503
            assert 1 <= int(refused.headers["retry-after"]) <= 6

            while (ready := http.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert ready.json()["status"] == "ready"
            assert ready.json()["reasons"] == []
            accepted = http.get("/v1/keys", headers=_signed(credential["client_id"], secret))
            assert accepted.status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        redis.kill()


def _signed(client_id: str, secret: bytes) -> dict[str, str]:
    return sign_request("GET", "/v1/keys", "", b"", client_id, secret)
