"""Behaviour that needs its own server configuration: policies, hot reload, limits, overload."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.test_api import assert_error, b64

pytestmark = pytest.mark.slow  # a live server for each configuration


def cryptd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        check=False,
    )


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(**env: str) -> Server:
        server = start_server(tmp_path / f"s{len(started)}", env)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_server(server)


def dev_env(server: Server) -> dict[str, str]:
    dev = server.directory / "dev"
    return {
        "CRYPTD_MASTER_KEY_FILE": str(dev / "master.key"),
        "CRYPTD_KEYRING_FILE": str(dev / "keyring.json"),
        "CRYPTD_CLIENTS_FILE": str(dev / "clients.json"),
    }


def test_policy_refusal_is_403_and_hot_reloaded_clients(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_KEYRING_RELOAD_INTERVAL="0.2")
    added = cryptd(
        "clients",
        "add",
        "limited",
        "--allow",
        "aes*:encrypt",
        "--file",
        str(server.directory / "dev" / "clients.json"),
    )
    assert added.returncode == 0, added.stderr
    secret = base64.b64decode(added.stdout.strip().splitlines()[0])

    def as_limited(method: str, path: str, body: object = None) -> httpx.Response:
        return server.request(method, path, body, client_id="limited", secret=secret)

    wait_for(
        lambda: as_limited("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}).status_code == 200
    )
    assert_error(
        as_limited("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": "x"}), 403, "forbidden"
    )
    assert_error(as_limited("POST", "/v1/encrypt/rsa-2048", {"plaintext": ""}), 403, "forbidden")
    assert_error(as_limited("POST", "/v1/keys/newkey", {"type": "aes256-gcm"}), 403, "forbidden")
    assert_error(as_limited("GET", "/v1/keys/aes256-gcm"), 403, "forbidden")
    listed = as_limited("GET", "/v1/keys").json()
    assert listed == {"keys": []}  # no "read" permission on any key
    # rewrap into a key the client may not encrypt with is refused, per item in a batch
    token = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}).json()["ciphertext"]
    added = cryptd(
        "clients",
        "add",
        "rewrapper",
        "--allow",
        "aes*:rewrap,encrypt",
        "--file",
        str(server.directory / "dev" / "clients.json"),
    )
    secret = base64.b64decode(added.stdout.strip().splitlines()[0])

    def rewrap(body: object) -> httpx.Response:
        return server.request(
            "POST", "/v1/rewrap/aes256-gcm", body, client_id="rewrapper", secret=secret
        )

    wait_for(lambda: rewrap({"ciphertext": token}).status_code == 200)
    assert_error(rewrap({"ciphertext": token, "to_key": "sm4-gcm"}), 403, "forbidden")
    batch = rewrap({"batch": [{"ciphertext": token}, {"ciphertext": token, "to_key": "sm2"}]})
    results = batch.json()["batch"]
    assert "ciphertext" in results[0]
    assert results[1]["error"]["code"] == "forbidden"


def test_keyring_hot_reload_and_bad_file(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_KEYRING_RELOAD_INTERVAL="0.2")
    env = dev_env(server)
    before = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"old")}).json()
    rotated = cryptd("keys", "rotate", "aes256-gcm", env=env)
    assert rotated.returncode == 0, rotated.stderr
    wait_for(lambda: server.request("GET", "/v1/keys/aes256-gcm").json()["latest_version"] == 2)
    after = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"new")}).json()
    assert after["key_version"] == 2
    # a corrupt keyring (a bad Secret update) keeps the previous keyring serving
    keyring = Path(env["CRYPTD_KEYRING_FILE"])
    good = keyring.read_bytes()
    keyring.write_bytes(good[: len(good) // 2])
    wait_for(
        lambda: "last_reload_error" in server.request("GET", "/readyz").json()["checks"]["keyring"]
    )
    ready = server.request("GET", "/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "degraded"
    assert "Traceback" not in server.log()
    for token, plain in ((before, b"old"), (after, b"new")):
        out = server.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": token["ciphertext"]})
        assert out.json()["plaintext"] == b64(plain)
    keyring.write_bytes(good)
    wait_for(lambda: server.request("GET", "/readyz").json()["status"] == "ready")


def test_sighup_reloads_keyring(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_KEYRING_RELOAD_INTERVAL="3600")
    env = dev_env(server)
    assert cryptd("keys", "rotate", "ed25519", env=env).returncode == 0
    time.sleep(0.5)
    assert server.request("GET", "/v1/keys/ed25519").json()["latest_version"] == 1
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: server.request("GET", "/v1/keys/ed25519").json()["latest_version"] == 2)


def test_limits_rate_and_overload(own_server: Callable[..., Server]) -> None:
    server = own_server(
        CRYPTD_MAX_BODY_BYTES="4096",
        CRYPTD_MAX_BATCH_ITEMS="10",
        CRYPTD_POOL_MAX_PENDING="1",
        CRYPTD_POOL_CHUNK_SIZE="2",
    )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"x" * 4096)}),
        413,
        "payload_too_large",
    )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"batch": [{"plaintext": ""}] * 11}),
        413,
        "payload_too_large",
    )
    # 10 RSA items in chunks of 2 are 5 pool tasks against room for 1: refused at once
    started = time.monotonic()
    overloaded = server.request("POST", "/v1/sign/rsa-4096", {"batch": [{"message": ""}] * 10})
    assert_error(overloaded, 503, "overloaded")
    assert int(overloaded.headers["retry-after"]) >= 1
    assert time.monotonic() - started < 5
    single = server.request("POST", "/v1/sign/rsa-4096", {"message": ""})
    assert single.status_code == 200


def test_rate_limit_429(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_RATE_LIMIT_PER_SECOND="2", CRYPTD_RATE_LIMIT_BURST="3")
    statuses = [
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}) for _ in range(6)
    ]
    limited = [r for r in statuses if r.status_code == 429]
    assert limited, [r.status_code for r in statuses]
    assert_error(limited[0], 429, "rate_limited")
    assert int(limited[0].headers["retry-after"]) >= 1
    assert statuses[0].status_code == 200


def test_read_only_keyring_refuses_management(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_KEYRING_READ_ONLY="true")
    assert_error(server.request("POST", "/v1/keys/k1", {"type": "aes256-gcm"}), 409, "conflict")
    assert_error(server.request("POST", "/v1/keys/aes256-gcm/rotate"), 409, "conflict")
    assert server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}).status_code == 200


def test_production_refuses_weak_configuration(tmp_path: Path) -> None:
    env = {
        "CRYPTD_ENV": "production",
        "CRYPTD_MASTER_KEY": "",
        "CRYPTD_MASTER_KEY_FILE": "",
        "CRYPTD_CLIENTS_FILE": "",
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", "1"],
        capture_output=True,
        text=True,
        env={**clean, **{k: v for k, v in env.items() if v}},
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "CRYPTD_MASTER_KEY" in result.stderr
    weak = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env={
            **clean,
            "CRYPTD_MASTER_KEY": base64.b64encode(b"\x00" * 32).decode(),
            "CRYPTD_CLIENTS_FILE": str(tmp_path / "c.json"),
            "CRYPTD_TLS": "off",  # TLS is refused on its own: tests/test_edge_tls.py
        },
    )
    assert weak.returncode != 0
    assert "entropy" in weak.stderr
