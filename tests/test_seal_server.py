"""The PKCS#11 seal in a running server (production settings, two workers, SoftHSM2)."""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import (
    Server,
    connections_to_every_worker,
    free_port,
    start_server,
    stop_server,
)
from tests.test_seal_support import Token, make_store, make_token

pytestmark = pytest.mark.slow

WORKERS = 2


def _environment(token: Token, base: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    return {
        **clean,
        **token.env(),
        "CRYPTD_ENV": "production",
        "CRYPTD_TLS": "off",
        "CRYPTD_CLIENTS_FILE": str(base / "clients.json"),
        "CRYPTD_KEYRING_FILE": str(base / "keyring.json"),
        "CRYPTD_WORKERS": str(WORKERS),
        # A fresh host replay store refuses its first max_skew seconds: keep that short.
        "CRYPTD_SIGNATURE_MAX_SKEW": "1",
    }


def _cryptd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def deployment(tmp_path: Path) -> tuple[Token, dict[str, str], bytes, bytes]:
    """A token, a master key sealed by `cryptd operator init` (known to the test only), a key
    store and a client (tests/test_seal.py runs those commands under the seal)."""
    token = make_token(tmp_path / "hsm")
    env = _environment(token, tmp_path)
    master = secrets.token_bytes(32)
    secret = make_store(tmp_path, master)
    handed_over = tmp_path / "handed-over.key"
    handed_over.write_text(base64.b64encode(master).decode())
    result = _cryptd(env, "operator", "init", "--master-key-file", str(handed_over))
    assert result.returncode == 0, result.stderr
    handed_over.unlink()  # from here on the key exists only sealed
    return token, env, master, secret


@contextlib.contextmanager
def _serve(
    env: dict[str, str], base: Path, secret: bytes, *, until: str = "/readyz", log: str = "server"
) -> Iterator[Server]:
    """The server, once ``until`` answers 200 (a sealed server is never ready: /healthz)."""
    port = free_port()
    log_path = base / f"{log}.log"
    with open(log_path, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            env=env,
            cwd=base,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, f"http://127.0.0.1:{port}", "app", secret, base, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, server.log()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + until, timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        yield server
    finally:
        stop_server(server)


def _encrypt(server: Server, connection: httpx.Client) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        answer = server.request(
            "POST", "/v1/encrypt/payments", {"plaintext": "aGVsbG8="}, connection=connection
        )
        # The fresh replay store's start-up window answers 503 "sign the request again".
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(0.3)


def test_two_workers_serve_from_the_token_and_survive_its_loss(
    deployment: tuple[Token, dict[str, str], bytes, bytes], tmp_path: Path
) -> None:
    token, env, master, secret = deployment
    with (
        _serve(env, tmp_path, secret) as server,
        connections_to_every_worker(server, WORKERS) as workers,
    ):
        ciphertexts = {}
        for index, connection in workers.items():
            answer = _encrypt(server, connection)
            assert answer.status_code == 200, answer.text
            ciphertexts[index] = answer.json()["ciphertext"]
            seal = connection.get("/readyz").json()["checks"]["seal"]
            assert seal == {"ok": True, "kind": "pkcs11", "available": True}
            status = connection.get("/v1/sys/seal-status")
            assert status.status_code == 200
            assert status.json() == {
                "sealed": False,
                "threshold": 1,
                "progress": 0,
                "type": "pkcs11",
                "available": True,
                "refused": 0,
            }

        # No master key in any process's environment, nor in the clear in any file here.
        pids = [server.process.pid, *_children(server.process.pid)]
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"CRYPTD_MASTER_KEY" not in environ
        encoded = base64.b64encode(master)
        for path in tmp_path.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert master not in data, path
                assert encoded not in data, path

        away = token.remove()
        time.sleep(1.1)  # the seal's status is cached for a second
        for index, connection in workers.items():
            ready = connection.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["status"] == "degraded"
            seal = ready.json()["checks"]["seal"]
            assert seal["available"] is False
            assert "token unavailable" in seal["reason"]
            status = connection.get("/v1/sys/seal-status").json()
            assert status["sealed"] is False
            assert status["available"] is False
            assert "token unavailable" in status["reason"]
            # Crypto keeps serving from the master key in memory.
            decrypted = server.request(
                "POST",
                "/v1/decrypt/payments",
                {"ciphertext": ciphertexts[index]},
                connection=connection,
            )
            assert decrypted.status_code == 200
            assert decrypted.json()["plaintext"] == "aGVsbG8="
            assert _encrypt(server, connection).status_code == 200

        token.restore(away)
        time.sleep(1.1)
        for connection in workers.values():
            assert connection.get("/readyz").json()["status"] == "ready"
    assert "Traceback" not in server.log()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found.extend(int(child) for child in children)
    return found


def test_start_refused_with_one_line(
    deployment: tuple[Token, dict[str, str], bytes, bytes], tmp_path: Path
) -> None:
    token, env, _, _ = deployment
    faults = (
        ({**env, "CRYPTD_PKCS11_TOKEN_LABEL": "absent-token"}, "no PKCS#11 token labelled"),
        ({**env, "CRYPTD_PKCS11_KEY_LABEL": "absent-key"}, "not pkcs11 key 'absent-key'"),
        (env, "the PIN in CRYPTD_PKCS11_PIN_FILE is wrong"),
    )
    for fault_env, expected in faults:
        if "PIN" in expected:
            token.pin_file.write_text("00000000\n")
        result = _cryptd(fault_env, "serve", "--port", str(free_port()))
        assert result.returncode == 2  # a configuration refused at start
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert result.stderr.startswith("cryptd: error: ")
        assert expected in result.stderr


def test_seal_status_is_the_one_unsigned_v1_route(server: Server) -> None:
    status = httpx.get(server.url + "/v1/sys/seal-status", timeout=10)
    assert status.status_code == 200
    assert status.json() == {
        "sealed": False,
        "threshold": 1,
        "progress": 0,
        "type": "static",
        "available": True,
        "refused": 0,
    }
    assert "x-request-id" in status.headers
    # Its neighbours stay signed, and so does any other method on it.
    for method, path in (
        ("GET", "/v1/keys"),
        ("GET", "/v1/sys/seal-status/"),
        ("GET", "/v1/sys/other"),
        ("POST", "/v1/sys/seal-status"),
    ):
        answer = server.request(method, path, sign=False)
        assert answer.status_code == 401, (method, path, answer.status_code)
        assert answer.json()["error"]["code"] == "unauthenticated"


def test_operator_unseal_over_tls_on_a_server_that_holds_its_key(tmp_path: Path) -> None:
    """The credential's CA reaches an https:// server; a server that is not sealed (here
    static) only reports its status, and the command succeeds."""
    server = start_server(tmp_path, tls=True)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "service", "operator", "unseal", "--credential",
             str(tmp_path / "dev" / "client.json"), "-"],
            input="any words at all\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
    finally:
        stop_server(server)
    assert result.returncode == 0, result.stderr
    report = orjson.loads(result.stdout)
    assert report == {
        "workers": {
            "0": {
                "sealed": False,
                "threshold": 1,
                "progress": 0,
                "type": "static",
                "available": True,
                "refused": 0,
            }
        }
    }
