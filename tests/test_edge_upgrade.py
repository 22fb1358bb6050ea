"""Upgrade offers are ignored and served as HTTP/1.1 with the body intact (Java's default
HttpClient and ``curl --http2`` send ``Upgrade: h2c``): raw bytes, curl and the real JDK."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from service.auth.signature import sign_request
from tests.conftest import Server
from tests.rawhttp import ResponseReader, connect, exchange, head_bytes

pytestmark = pytest.mark.slow  # live servers, Java and curl clients

JAVA_SOURCE = Path(__file__).parent / "java" / "SignedCalls.java"
H2C = {
    "Connection": "Upgrade, HTTP2-Settings",
    "Upgrade": "h2c",
    "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA",
}


def require_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required under CI")
        pytest.skip(f"{name} is not installed")
    return found


def signed(
    server: Server,
    path: str,
    document: object,
    *,
    extra: dict[str, str] | None = None,
    chunked: bool = False,
) -> tuple[bytes, bytes]:
    """(head, body) of a signed POST, ``extra`` header fields first."""
    body = orjson.dumps(document)
    headers = dict(extra or {})
    headers.update(sign_request("POST", path, "", body, server.client_id, server.secret))
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
        half = len(body) // 2
        body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]))
        body += b"0\r\n\r\n"
    else:
        headers["Content-Length"] = str(len(body))
    return head_bytes("POST", path, headers), body


def encrypt_then_decrypt(server: Server, plaintext: bytes, **options: object) -> None:
    """Encrypt over an upgrade offer, then decrypt the token: both bodies must have arrived."""
    document = {"plaintext": base64.b64encode(plaintext).decode()}
    head, body = signed(server, "/v1/encrypt/aes256-gcm", document, extra=H2C, **options)  # type: ignore[arg-type]
    (response,) = exchange(server.url, [head + body])
    assert response.status == 200, response.body
    assert response.version == "HTTP/1.1"
    token = orjson.loads(response.body)["ciphertext"]
    check = server.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": token})
    assert base64.b64decode(check.json()["plaintext"]) == plaintext


def test_content_length_body_after_h2c_offer(server: Server) -> None:
    encrypt_then_decrypt(server, b"over an h2c offer")


def test_chunked_body_after_h2c_offer(server: Server) -> None:
    encrypt_then_decrypt(server, b"chunked over an h2c offer", chunked=True)


def test_any_upgrade_offer_is_ignored(server: Server) -> None:
    offer = {"Connection": "upgrade", "Upgrade": "websocket"}
    head, body = signed(server, "/v1/encrypt/aes256-gcm", {"plaintext": ""}, extra=offer)
    (response,) = exchange(server.url, [head + body])
    assert response.status == 200, response.body


@pytest.mark.parametrize("split", ["head|body", "head|half|half", "byte by byte"])
def test_body_in_later_packets(server: Server, split: str) -> None:
    head, body = signed(server, "/v1/encrypt/aes256-gcm", {"plaintext": "aGk="}, extra=H2C)
    if split == "head|body":
        chunks = [head, body]
    elif split == "head|half|half":
        chunks = [head, body[:5], body[5:]]
    else:
        chunks = [head] + [bytes([b]) for b in body]
    (response,) = exchange(server.url, chunks, pause=0.02)
    assert response.status == 200, response.body


def test_keep_alive_and_pipelining_after_offers(server: Server) -> None:
    """Several offers on one connection, pipelined in one write and then one at a time; a
    GET offer (no body) between them."""
    first = b"".join(signed(server, "/v1/encrypt/aes256-gcm", {"plaintext": "MQ=="}, extra=H2C))
    second = b"".join(
        signed(server, "/v1/encrypt/aes256-gcm", {"plaintext": "Mg=="}, extra=H2C, chunked=True)
    )
    health = head_bytes("GET", "/healthz", H2C)
    plain = b"".join(signed(server, "/v1/encrypt/aes256-gcm", {"plaintext": "Mw=="}))
    with connect(server.url) as sock:
        reader = ResponseReader(sock)
        sock.sendall(first + health + second)
        answers = [reader.read() for _ in range(3)]
        sock.sendall(plain)
        answers.append(reader.read())
        sock.sendall(first)  # the same nonce again: refused as a replay, not hung
        answers.append(reader.read())
    assert [a.status for a in answers] == [200, 200, 200, 200, 401]
    assert answers[1].json() == {"status": "ok"}


def test_bad_chunked_body_after_offer_is_400(server: Server) -> None:
    head, _ = signed(server, "/v1/encrypt/aes256-gcm", {"plaintext": ""}, extra=H2C, chunked=True)
    (response,) = exchange(server.url, [head + b"zz\r\nnot hex\r\n"])
    assert response.status == 400
    assert server.request("GET", "/healthz", sign=False).status_code == 200


@pytest.mark.parametrize("tls", [False], ids=["plain"])
def test_curl_http2(server: Server, tls: bool) -> None:
    curl = require_tool("curl")
    body = orjson.dumps({"plaintext": base64.b64encode(b"from curl").decode()})
    path = "/v1/encrypt/aes256-gcm"
    args = [curl, "-sS", "-v", "--http2", "--data-binary", "@-", server.url + path]
    headers = sign_request("POST", path, "", body, server.client_id, server.secret)
    for name, value in headers.items():
        args += ["-H", f"{name}: {value}"]
    done = subprocess.run(args, input=body, capture_output=True, timeout=30, check=False)
    assert b"> Upgrade: h2c" in done.stderr  # curl did offer the upgrade
    assert b"< HTTP/1.1 200" in done.stderr, done.stderr.decode(errors="replace")
    assert orjson.loads(done.stdout)["key_version"] == 1


# --- the JDK -------------------------------------------------------------------------------


def run_java(*args: str) -> list[str]:
    java = require_tool("java")
    done = subprocess.run(
        [java, str(JAVA_SOURCE), *args], capture_output=True, timeout=180, check=False, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


@pytest.fixture
def capture_server() -> Iterator[tuple[str, list[bytes]]]:
    """A bare socket server that records request heads and answers a fixed JSON body."""
    heads: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    answer = b'{"ciphertext":"c","signature":"s"}'

    def serve_one(conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buffer += data
                while b"\r\n\r\n" in buffer:
                    head, _, rest = buffer.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if len(rest) < length:
                        break
                    heads.append(head)
                    buffer = rest[length:]
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                    )

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", heads
    listener.close()


def test_java_default_client_offers_h2c(capture_server: tuple[str, list[bytes]]) -> None:
    """The premise: on http:// the JDK's default client offers the upgrade on every request."""
    url, heads = capture_server
    run_java(url, "dev", base64.b64encode(b"\x01" * 32).decode())
    assert len(heads) >= 10
    assert all(b"\r\nUpgrade: h2c" in head for head in heads)


def test_java_default_client_gets_2xx_on_every_route(server: Server) -> None:
    lines = run_java(server.url, server.client_id, base64.b64encode(server.secret).decode())
    calls = [line.split(" ", 4) for line in lines]
    routes = {f"{method} {path.split('/java-')[0]}" for _, method, path, *_ in calls}
    assert {
        "POST /v1/encrypt/aes256-gcm",
        "POST /v1/decrypt/aes256-gcm",
        "POST /v1/rewrap/aes256-gcm",
        "POST /v1/datakey/aes256-gcm",
        "POST /v1/sign/ed25519",
        "POST /v1/verify/ed25519",
        "GET /v1/keys",
        "GET /v1/keys/rsa-2048",
        "POST /v1/keys",
        "PATCH /v1/keys",
        "DELETE /v1/keys",
        "GET /healthz",
        "GET /readyz",
        "GET /metrics",
    } <= routes
    for status, method, path, version, *_ in calls:
        assert status in ("200", "201", "204"), (status, method, path)
        assert version == "HTTP_1_1"
    decrypted = next(line for line in lines if " /v1/decrypt/" in line)
    assert base64.b64encode(b"hello from java").decode() in decrypted
    verified = next(line for line in lines if " /v1/verify/" in line)
    assert verified.endswith('{"valid":true}')
