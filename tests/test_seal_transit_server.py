"""The transit seal in a running server (production settings, two workers, a real OpenBao):
every worker unwraps at start; OpenBao gone while serving degrades, never stops crypto."""

from __future__ import annotations

import base64
import os
import secrets
import time
from pathlib import Path

import pytest

from tests.conftest import connections_to_every_worker, free_port
from tests.test_seal_server import _cryptd, _encrypt, _serve
from tests.test_seal_support import make_store
from tests.transit_support import Bao

pytestmark = pytest.mark.slow

WORKERS = 2


def _environment(bao: Bao, base: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    return {
        **clean,
        **bao.env(),
        "CRYPTD_ENV": "production",
        "CRYPTD_TLS": "off",
        "CRYPTD_CLIENTS_FILE": str(base / "clients.json"),
        "CRYPTD_KEYRING_FILE": str(base / "keyring.json"),
        "CRYPTD_WORKERS": str(WORKERS),
        "CRYPTD_SIGNATURE_MAX_SKEW": "1",
    }


def test_workers_unwrap_at_start_and_outlive_openbao(tmp_path: Path) -> None:
    bao = Bao(tmp_path / "openbao").start()
    try:
        env = _environment(bao, tmp_path)
        master = secrets.token_bytes(32)
        secret = make_store(tmp_path, master)
        handed_over = tmp_path / "handed-over.key"
        handed_over.write_text(base64.b64encode(master).decode())
        result = _cryptd(env, "operator", "init", "--master-key-file", str(handed_over))
        assert result.returncode == 0, result.stderr
        handed_over.unlink()

        check = _cryptd(env, "serve", "--check")
        assert check.returncode == 0, check.stderr
        assert "wrapped by Transit key 'cryptd-seal'" in check.stdout + check.stderr

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
                assert seal == {"ok": True, "kind": "transit", "available": True}

            # Online rotation: the worker that runs it wraps a new master key with the
            # Transit key; every worker (and pool process) finds it through the Transit seal.
            rotation = server.request("POST", "/v1/sys/rotate-master-key", {})
            assert rotation.status_code == 200, rotation.text
            assert rotation.json()["seal"] == "transit"
            deadline = time.monotonic() + 20
            for connection in workers.values():
                while True:
                    answer = server.request(
                        "POST", "/v1/keys/payments/rotate", {}, connection=connection
                    )
                    if answer.status_code == 200 or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)  # this worker has not seen the new store yet
                assert answer.status_code == 200, answer.text

            bao.stop()
            time.sleep(2.1)  # the seal's status is cached for two seconds
            for index, connection in workers.items():
                ready = connection.get("/readyz")
                assert ready.status_code == 200
                assert ready.json()["status"] == "degraded"
                seal = ready.json()["checks"]["seal"]
                assert seal["available"] is False
                assert "Transit unavailable" in seal["reason"]
                assert "cannot be reached" in seal["reason"]
                status = connection.get("/v1/sys/seal-status").json()
                assert status["sealed"] is False
                assert status["available"] is False
                decrypted = server.request(
                    "POST",
                    "/v1/decrypt/payments",
                    {"ciphertext": ciphertexts[index]},
                    connection=connection,
                )
                assert decrypted.status_code == 200
                assert decrypted.json()["plaintext"] == "aGVsbG8="
                assert _encrypt(server, connection).status_code == 200
            # What needs the seal again answers 503 with Retry-After, and nothing changed.
            before = (tmp_path / "keyring.json").read_bytes()
            rotation = server.request("POST", "/v1/sys/rotate-master-key", {})
            assert rotation.status_code == 503, rotation.text
            assert rotation.headers["retry-after"] == "1"
            assert rotation.json()["error"]["code"] == "sealed"
            assert "cannot be reached" in rotation.json()["error"]["message"]
            assert (tmp_path / "keyring.json").read_bytes() == before
            assert not (tmp_path / "sealed-master-key.json.next").exists()
        assert "Traceback" not in server.log()

        # A start without OpenBao: one line, exit 2, nothing served.
        result = _cryptd(env, "serve", "--port", str(free_port()))
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert result.stderr.startswith("cryptd: error: ")
        assert "the Transit service at" in result.stderr
        assert "cannot be reached" in result.stderr
    finally:
        bao.stop()
