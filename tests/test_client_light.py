"""The light client distribution (client/ -> cryptd-client): installs with httpx and nothing
of the server, signs a real round trip, and refuses values whose type is not the wire's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryptd_client import CryptdClient, sign_request
from tests.conftest import Server

ROOT = Path(__file__).resolve().parents[1]
# What httpx itself needs; nothing else may come with the client.
HTTPX_CLOSURE = {"httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio"}
BASE = {"pip", "setuptools", "wheel", "typing-extensions", "typing_extensions"}
SERVER_ONLY = {"fastapi", "starlette", "uvicorn", "pydantic", "cryptography", "orjson", "redis"}

ROUND_TRIP = """
import json, sys
from cryptd_client import CryptdClient
with CryptdClient.from_file(sys.argv[1]) as cryptd:
    token = cryptd.encrypt("aes256-gcm", b"light client", aad=b"ctx").ciphertext
    plain = cryptd.decrypt("aes256-gcm", token, aad=b"ctx").plaintext
    signature = cryptd.sign("ed25519", b"light client").signature
    valid = cryptd.verify("ed25519", b"light client", signature=signature)
loaded = sorted(m.split(".")[0] for m in sys.modules)
print(json.dumps({"plain": plain.decode(), "valid": valid, "token": token, "modules": loaded}))
"""


@pytest.mark.slow
def test_fresh_venv_gets_httpx_only_and_round_trips(server: Server, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(ROOT / "client")],
        check=True,
        env=environ,
        cwd=tmp_path,
        timeout=300,
    )
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"],
        check=True,
        env=environ,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert "cryptd-client" in installed
    assert not installed & SERVER_ONLY
    assert installed - {"cryptd-client"} <= HTTPX_CLOSURE | BASE, installed

    credential = server.directory / "dev" / "client.json"
    result = subprocess.run(
        [python, "-c", ROUND_TRIP, str(credential)],
        check=True,
        env=environ,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: nothing of it is importable
    )
    answer = json.loads(result.stdout)
    assert answer["plain"] == "light client"
    assert answer["valid"] is True
    assert answer["token"].startswith("cryptd:v")
    assert not {"service", "fastapi", "pydantic", "cryptography"} & set(answer["modules"])


def test_the_server_signs_with_the_client_implementation() -> None:
    from service.auth import signature

    assert signature.sign_request is sign_request


@pytest.fixture
def offline() -> Iterator[CryptdClient]:
    # No request is sent: each call below fails its type check first.
    with CryptdClient("http://127.0.0.1:9", "someone", "c2VjcmV0LXNlY3JldC1zZWNyZXQ=") as client:
        yield client


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.encrypt("k", "abcd"), "plaintext must be bytes, not str"),
        (lambda c: c.encrypt("k", b"x", aad="ctx"), "aad must be bytes, not str"),
        (lambda c: c.sign("k", "hello world"), "message must be bytes, not str"),
        (lambda c: c.sign("k", digest="00" * 32), "digest must be bytes, not str"),
        (lambda c: c.verify("k", b"m", signature="c2ln"), "signature must be bytes, not str"),
        (lambda c: c.decrypt("k", b"cryptd:v1:AA"), "ciphertext is a token (str)"),
        (lambda c: c.encrypt("k", b"x", key_version="1"), "key_version must be int, not str"),
        (lambda c: c.encrypt("k", b"x", key_version=True), "key_version must be int, not bool"),
        (lambda c: c.datakey("k", bits="256"), "bits must be int, not str"),
        (lambda c: c.encrypt_batch("k", ["abcd"]), "plaintext must be bytes, not str"),
        (lambda c: c.decrypt_batch("k", [b"cryptd:v1:AA"]), "ciphertext is a token (str)"),
        (lambda c: c.hmac("k", "text"), "message must be bytes, not str"),
        (lambda c: c.encrypt("k", b"x", context="ctx"), "context must be bytes, not str"),
        (lambda c: c.random("16"), "bytes must be int, not str"),
        (lambda c: c.encrypt_batch("k", [{"plaintext": "abcd"}]), "plaintext must be bytes"),
    ],
)
def test_a_str_where_bytes_belong_raises_type_error(
    offline: CryptdClient, call: object, message: str
) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        call(offline)  # type: ignore[operator]


def test_sign_request_refuses_a_text_secret_or_body() -> None:
    with pytest.raises(TypeError, match="secret must be bytes"):
        sign_request("GET", "/v1/keys", "", b"", "c", "c2VjcmV0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="body must be bytes"):
        sign_request("POST", "/v1/keys", "", "{}", "c", b"s" * 32)  # type: ignore[arg-type]


def test_external_ciphertext_bytes_are_allowed_with_a_format(offline: CryptdClient) -> None:
    from cryptd_client._calls import _decrypt

    call = _decrypt("sm2", b"\x04\x01", None, "sm2", None, None)
    assert call.payload == {"ciphertext": "BAE=", "format": "sm2"}
    with pytest.raises(TypeError, match="with format="):
        _decrypt("k", bytearray(b"x"), None, None, None, None)  # type: ignore[arg-type]


def test_module_has_no_server_imports() -> None:
    code = (
        "import sys, cryptd_client; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('service', 'fastapi', 'pydantic', 'orjson')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
