"""The known-answer vector of docs/AUTH.md: the signer reproduces it byte for byte, the
document quotes it exactly, and the real application (its whole edge: body limit, signature
middleware, replay store, routes) accepts the request, with its clock set to ``created``."""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from cryptd_client import sign_request
from cryptd_client.signing import COVERED_COMPONENTS, signature_base
from service.api.application import create_app
from service.auth.clients import write_document
from service.config import Settings
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey

ROOT = Path(__file__).resolve().parents[1]
VECTOR = json.loads((ROOT / "tests" / "vectors" / "request_signature.json").read_text())
SECRET = base64.b64decode(VECTOR["secret"])


def test_signer_reproduces_the_vector() -> None:
    headers = sign_request(
        VECTOR["method"],
        VECTOR["path"],
        VECTOR["query"],
        VECTOR["body"].encode(),
        VECTOR["client_id"],
        SECRET,
        created=VECTOR["created"],
        nonce=VECTOR["nonce"],
    )
    assert headers == VECTOR["headers"]
    params = VECTOR["headers"]["Signature-Input"].removeprefix("sig1=")
    base = signature_base(
        list(
            zip(
                COVERED_COMPONENTS,
                (
                    VECTOR["method"],
                    VECTOR["path"],
                    "?",
                    VECTOR["headers"]["Content-Digest"],
                    "application/json",
                ),
                strict=True,
            )
        ),
        params,
    )
    assert base.decode() == VECTOR["signature_base"]


def test_auth_md_and_the_openapi_document_quote_the_vector() -> None:
    auth = (ROOT / "docs" / "AUTH.md").read_text()
    assert VECTOR["signature_base"] in auth
    for name, value in VECTOR["headers"].items():
        assert f"{name}: {value}" in auth
    for value in (VECTOR["secret"], VECTOR["nonce"], str(VECTOR["created"]), VECTOR["body"]):
        assert value in auth
    openapi = (ROOT / "docs" / "openapi.json").read_text()
    assert VECTOR["headers"]["Signature"] in openapi


@pytest.fixture
async def vector_app(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    keyring = tmp_path / "keyring.json"
    create_keyring_file(keyring, MasterKey(master))
    manager = KeyManager(FileKeyStore(keyring), MasterKey(master))
    manager.load()
    manager.create("orders", "aes256-gcm")
    clients = tmp_path / "clients.json"
    write_document(
        clients,
        {
            "clients": {
                VECTOR["client_id"]: {
                    "secret": VECTOR["secret"],
                    "allow": [{"keys": "orders", "operations": ["encrypt", "decrypt"]}],
                }
            }
        },
    )
    settings = Settings(
        env="production",
        tls="off",  # called in-process: no socket, no TLS to terminate
        master_key_file=tmp_path / "master.key",
        keyring_file=keyring,
        clients_file=clients,
        audit_log="off",
        docs=False,
    )
    # The vector's `created` is a fixed instant: the service's clock is put there.
    app = create_app(settings, clock=lambda: VECTOR["created"] + 1.0)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cryptd") as http:
            yield http


async def test_the_service_accepts_the_vector_once(vector_app: httpx.AsyncClient) -> None:
    async def send() -> httpx.Response:
        return await vector_app.request(
            VECTOR["method"],
            VECTOR["path"],
            content=VECTOR["body"].encode(),
            headers=VECTOR["headers"],
        )

    accepted = await send()
    assert accepted.status_code == 200, accepted.text
    token = accepted.json()["ciphertext"]
    assert token.startswith("cryptd:v1:")

    # The same signed request again is a replay.
    replayed = await send()
    assert replayed.status_code == 401
    assert replayed.json()["error"]["code"] == "unauthenticated"

    # And the token decrypts to the vector's plaintext ("hello world").
    body = json.dumps({"ciphertext": token}).encode()
    headers = sign_request(
        "POST",
        "/v1/decrypt/orders",
        "",
        body,
        VECTOR["client_id"],
        SECRET,
        created=VECTOR["created"],
    )
    decrypted = await vector_app.post("/v1/decrypt/orders", content=body, headers=headers)
    assert decrypted.status_code == 200, decrypted.text
    assert base64.b64decode(decrypted.json()["plaintext"]) == b"hello world"


async def test_one_changed_byte_is_refused(vector_app: httpx.AsyncClient) -> None:
    headers = dict(VECTOR["headers"])
    headers["Signature"] = headers["Signature"].replace("stH3", "stH4")
    refused = await vector_app.post(
        VECTOR["path"], content=VECTOR["body"].encode(), headers=headers
    )
    assert refused.status_code == 401
    tampered_body = VECTOR["body"].replace("aGVs", "aGVt").encode()
    refused = await vector_app.post(
        VECTOR["path"], content=tampered_body, headers=VECTOR["headers"]
    )
    assert refused.status_code == 401
