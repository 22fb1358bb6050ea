"""A server started sealed (CRYPTD_SEAL=shamir, two workers): the gate, unsealing every worker
with `cryptd operator unseal`, refused shares, and sealed again after a restart."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from service.auth.clients import generate_secret, write_document
from service.seal.shamir import split
from tests.conftest import Server, connections_to_every_worker
from tests.test_seal_server import _cryptd, _encrypt, _serve
from tests.test_seal_support import make_store

pytestmark = pytest.mark.slow

WORKERS = 2


def _unseal(env: dict[str, str], credential: Path, share: str) -> tuple[int, dict[str, object]]:
    result = subprocess.run(
        [sys.executable, "-m", "service", "operator", "unseal", "--credential", str(credential)],
        input=share + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, orjson.loads(result.stdout) if result.stdout else {}


def _status(server: Server, connection: httpx.Client) -> dict[str, object]:
    answer = connection.get("/v1/sys/seal-status")
    assert answer.status_code == 200
    body: dict[str, object] = answer.json()
    return body


def test_sealed_start_unseal_every_worker_and_seal_again(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    env = {
        **clean,
        "CRYPTD_SEAL": "shamir",
        "CRYPTD_ENV": "production",
        "CRYPTD_TLS": "off",
        "CRYPTD_CLIENTS_FILE": str(tmp_path / "clients.json"),
        "CRYPTD_KEYRING_FILE": str(tmp_path / "keyring.json"),
        "CRYPTD_WORKERS": str(WORKERS),
        "CRYPTD_SIGNATURE_MAX_SKEW": "1",
    }
    master = secrets.token_bytes(32)
    secret = make_store(tmp_path, master)
    key_file = tmp_path / "handed-over.key"
    key_file.write_text(base64.b64encode(master).decode())
    made = _cryptd(
        env, "operator", "init", "--shares", "3", "--threshold", "2", "--json",
        "--master-key-file", str(key_file),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    key_file.unlink()
    shares = orjson.loads(made.stdout)["shares"]
    foreign = split(tmp_path / "foreign.json", 2, 2)[0]
    operator_secret = generate_secret()
    clients = orjson.loads((tmp_path / "clients.json").read_bytes())["clients"]
    clients["operator"] = {"secret": operator_secret, "admin": True, "allow": []}
    clients["app"]["admin"] = False
    write_document(tmp_path / "clients.json", {"clients": clients})
    secrets_ = {"operator": operator_secret, "app": base64.b64encode(secret).decode()}

    with _serve(env, tmp_path, base64.b64decode(secrets_["app"]), until="/healthz") as server:
        credential = tmp_path / "operator.json"
        credential.write_text(
            orjson.dumps(
                {"url": server.url, "client_id": "operator", "secret": secrets_["operator"]}
            ).decode()
        )
        app_credential = tmp_path / "app.json"
        app_credential.write_text(
            orjson.dumps(
                {"url": server.url, "client_id": "app", "secret": secrets_["app"]}
            ).decode()
        )
        sealed_readyz = httpx.get(server.url + "/readyz", timeout=10)
        assert sealed_readyz.status_code == 503
        assert sealed_readyz.json()["checks"]["seal"]["sealed"] is True
        # Every /v1/ route answers 503 sealed, signed or not; the seal's own are open.
        for method, path in (("POST", "/v1/encrypt/payments"), ("GET", "/v1/keys")):
            for sign in (True, False):
                answer = server.request(method, path, {"plaintext": "aGk="}, sign=sign)
                assert answer.status_code == 503, (method, path, sign)
                assert answer.json()["error"]["code"] == "sealed"
        assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200

        # A non-admin client may not unseal; the share is not counted.
        code, report = _unseal(env, app_credential, shares[0])
        assert code == 1
        workers = report["workers"]
        assert isinstance(workers, dict)
        assert {w["status"] for w in workers.values()} == {403}

        code, report = _unseal(env, credential, shares[0])
        assert code == 0, report
        workers = report["workers"]
        assert isinstance(workers, dict)
        assert sorted(workers) == ["0", "1"]
        assert all(w["progress"] == 1 and w["sealed"] is True for w in workers.values())

        # Repeated, foreign, altered: refused 400 by every worker, counted, progress kept.
        # A sealed worker's /readyz (503) names it, so each can be reached.
        altered = " ".join([*shares[1].split()[:-1], "academic"])
        with connections_to_every_worker(server, WORKERS) as connections:
            for connection in connections.values():
                for bad in (shares[0], foreign, altered):
                    answer = server.request(
                        "POST",
                        "/v1/sys/unseal",
                        {"share": bad},
                        client_id="operator",
                        secret=base64.b64decode(operator_secret),
                        connection=connection,
                    )
                    assert answer.status_code == 400
                    assert answer.json()["error"]["code"] == "invalid_request"
                status = _status(server, connection)
                assert (status["sealed"], status["progress"], status["refused"]) == (True, 1, 3)

        code, report = _unseal(env, credential, shares[2])
        assert code == 0, report
        workers = report["workers"]
        assert isinstance(workers, dict)
        assert all(w["sealed"] is False for w in workers.values())

        with connections_to_every_worker(server, WORKERS) as connections:
            for connection in connections.values():
                assert connection.get("/readyz").json()["status"] == "ready"
                assert _status(server, connection)["sealed"] is False
                answer = _encrypt(server, connection)
                assert answer.status_code == 200, answer.text
        # Submitting again to an unsealed server changes nothing.
        code, report = _unseal(env, credential, shares[0])
        assert code == 0
    log = server.log()
    assert "Traceback" not in log
    for share in (*shares, foreign):
        assert " ".join(share.split()[:4]) not in log

    # A restart seals again.
    with _serve(env, tmp_path, b"", until="/healthz", log="restart") as again:
        status = httpx.get(again.url + "/v1/sys/seal-status", timeout=10).json()
        assert (status["sealed"], status["progress"]) == (True, 0)
