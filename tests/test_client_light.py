"""The light client distribution (client/ -> cryptd-client): installs with httpx and nothing
of the server, signs a real round trip, and refuses values whose type is not the wire's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from cryptd_client import (
    CryptdAPIError,
    CryptdClient,
    CryptdConfigurationError,
    CryptdConnectionError,
    OverloadedError,
    sign_request,
)
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
    # From a copy: a build from the source tree leaves client/build/ in the checkout, which
    # then holds a second copy of the package for the type checker.
    source = shutil.copytree(
        ROOT / "client", tmp_path / "client", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(source)],
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
    from cryptd_client._crypto_endpoints import CryptoEndpoints

    decrypt = vars(CryptoEndpoints)["decrypt"].build  # the request, not sent
    call = decrypt(offline, "sm2", b"\x04\x01", format="sm2")
    assert call.payload == {"ciphertext": "BAE=", "format": "sm2"}
    with pytest.raises(TypeError, match="with format="):
        decrypt(offline, "k", bytearray(b"x"))


def test_module_has_no_server_imports() -> None:
    code = (
        "import sys, cryptd_client; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('service', 'fastapi', 'pydantic', 'orjson')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("localhost:8080", "must start with http:// or https://"),
        ("127.0.0.1:8080", "must start with http:// or https://"),
        ("cryptd.example", "must start with http:// or https://"),
        ("ftp://cryptd.example", "must start with http:// or https://"),
        ("http://", "must start with http:// or https://"),
        ("http://cryptd.example:80x", "not a valid URL"),
        ("https://user:pw@cryptd.example", "user or password"),
        ("https://cryptd.example/?a=1", "query or fragment"),
    ],
)
def test_a_url_that_cannot_work_is_refused_at_construction(url: str, message: str) -> None:
    with pytest.raises(CryptdConfigurationError, match=re.escape(message)) as info:
        CryptdClient(url, "c", "c2VjcmV0")
    assert isinstance(info.value, ValueError)  # what code catching the lower error expects
    assert "pw" not in str(info.value)


def test_a_secret_that_is_not_base64_is_refused_without_echo(tmp_path: Path) -> None:
    for secret in ("not base64!", "c2VjcmV0!", "abc", ""):
        with pytest.raises(CryptdConfigurationError, match="secret is") as info:
            CryptdClient("http://127.0.0.1:1", "c", secret)
        # No binascii.Error shown beneath it.
        assert info.value.__cause__ is None
        assert info.value.__context__ is None or info.value.__suppress_context__
        if secret:
            assert secret not in str(info.value)
    credential = tmp_path / "client.json"
    credential.write_text(json.dumps({"url": "http://h:1", "client_id": "c", "secret": "x y"}))
    with pytest.raises(CryptdConfigurationError, match=f"^{re.escape(str(credential))}: secret"):
        CryptdClient.from_file(credential)


def test_state_changing_key_management_is_marked_not_idempotent(offline: CryptdClient) -> None:
    from cryptd_client._crypto_endpoints import CryptoEndpoints
    from cryptd_client._key_endpoints import KeyEndpoints

    def work(cls: type, name: str, *args: object, **kwargs: object) -> Any:
        return vars(cls)[name].build(offline, *args, **kwargs)

    changing = {
        "create_key": work(KeyEndpoints, "create_key", "k", "aes256-gcm"),
        "rotate_key": work(KeyEndpoints, "rotate_key", "k"),
        "update_key": work(KeyEndpoints, "update_key", "k", state="disabled"),
        "delete_key": work(KeyEndpoints, "delete_key", "k"),
        "cancel_deletion": work(KeyEndpoints, "cancel_deletion", "k"),
        "restore_key": work(KeyEndpoints, "restore_key", "k", "backup"),
    }
    assert {name: call.idempotent for name, call in changing.items()} == dict.fromkeys(
        changing, False
    )
    reading = [
        work(KeyEndpoints, "get_key", "k"),
        work(KeyEndpoints, "list_keys"),
        work(KeyEndpoints, "backup_key", "k"),
        work(KeyEndpoints, "wrapping_key"),
        work(CryptoEndpoints, "encrypt", "k", b"x"),
        work(CryptoEndpoints, "random", 8),
    ]
    assert all(call.idempotent for call in reading)
    # import sends its material in a second call, after reading the wrapping key.
    plan = work(KeyEndpoints, "import_key", "k", "aes256-gcm", b"\x00" * 32)
    assert next(plan).idempotent
    wrapping = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    pem = wrapping.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
    assert plan.send(pem).idempotent is False


def _attempts(client: CryptdClient, call: Any, outcomes: list[Any]) -> tuple[int, Any]:
    """Drive one call's retry decisions with these outcomes (no I/O): the number of requests
    it made, and what it ended with (its result, or the error it raised)."""
    steps = client._steps(call)
    sent = 0
    try:
        for action in steps:
            if isinstance(action, httpx.Request):
                steps.answer(outcomes[sent])
                sent += 1
    except Exception as exc:  # the call's own error
        return sent, exc
    return sent, steps.result


def test_retry_decisions(offline: CryptdClient) -> None:
    from cryptd_client._crypto_endpoints import CryptoEndpoints
    from cryptd_client._key_endpoints import KeyEndpoints

    request = httpx.Request("POST", "http://127.0.0.1:1/")
    refused = httpx.Response(
        503,
        headers={"Retry-After": "0"},
        json={
            "error": {
                "code": "overloaded",
                "message": "replay store restarted: sign the request again",
            }
        },
    )
    ok = httpx.Response(200, json={"random": "AAAAAAAAAAA="})
    client = CryptdClient("http://127.0.0.1:1", "c", "c2VjcmV0", retries=3)
    with client:
        random = vars(CryptoEndpoints)["random"].build(client, 8)
        assert _attempts(client, random, [refused, refused, ok]) == (3, bytes(8))
        sent, error = _attempts(client, random, [refused] * 5)
        assert sent == 4
        assert isinstance(error, OverloadedError)
        # A Retry-After beyond the longest single wait is not slept through.
        late = httpx.Response(503, headers={"Retry-After": "3600"}, json=refused.json())
        assert _attempts(client, random, [late, ok])[0] == 1

        rotate = vars(KeyEndpoints)["rotate_key"].build(client, "k")
        sent, error = _attempts(client, rotate, [refused, ok])
        assert sent == 1
        assert isinstance(error, OverloadedError)
        lost = httpx.RemoteProtocolError("closed", request=request)
        sent, error = _attempts(client, rotate, [lost, ok])
        assert sent == 1
        assert isinstance(error, CryptdConnectionError)
        # Never sent at all: sending it now is its first copy.
        never = httpx.ConnectError("refused", request=request)
        metadata = {"name": "k", "type": "aes256-gcm", "latest_version": 2}
        rotated = httpx.Response(200, json={**metadata, "min_decryption_version": 1})
        assert _attempts(client, rotate, [never, rotated])[0] == 2
        # Sent, and no answer came (a host cut off; a balancer closing a dead host's
        # sessions): a crypto call is signed afresh and sent again; key management raises.
        for lost_answer in (
            httpx.ReadTimeout("timed out", request=request),
            httpx.ReadError("reset", request=request),
        ):
            assert _attempts(client, random, [lost_answer, ok]) == (2, bytes(8))
            sent, error = _attempts(client, rotate, [lost_answer, rotated])
            assert (sent, error) == (1, lost_answer)
            sent, error = _attempts(client, random, [lost_answer] * 5)
            assert (sent, error) == (4, lost_answer)
        # A proxy's 502 (HAProxy closing a session it took out) or 504: the same lost answer.
        for status in (502, 504):
            proxy = httpx.Response(status, html="<html><body>Bad Gateway</body></html>")
            assert _attempts(client, random, [proxy, ok]) == (2, bytes(8))
            sent, error = _attempts(client, rotate, [proxy, rotated])
            assert sent == 1
            assert isinstance(error, CryptdAPIError)
            assert (error.status, error.code) == (status, "unknown")
    # The time spent waiting for a lost answer counts toward max_total_wait: 0.12 s waited
    # plus the first backoff (0.1 s) is past 0.15 s, where 0.1 s alone would be retried.
    with CryptdClient("http://127.0.0.1:1", "c", "c2VjcmV0", max_total_wait=0.15) as impatient:
        steps = impatient._steps(vars(CryptoEndpoints)["random"].build(impatient, 8))
        timed_out = httpx.ReadTimeout("timed out", request=request)
        actions = iter(steps)
        assert isinstance(next(actions), httpx.Request)
        time.sleep(0.12)
        steps.answer(timed_out)
        with pytest.raises(httpx.ReadTimeout):
            next(actions)  # given up, not a sleep before a second attempt
