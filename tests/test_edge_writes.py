"""A response leaves the edge in one write: over TLS, one record per answer (head and body
together), on a real server, with the client's TLS on memory buffers so that every record on
the wire is seen. The interim ``100 Continue``, HEAD answers (a head without a body) and
pipelined requests keep working."""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from service.auth.signature import sign_request
from tests.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # live servers

RECORD_HEADER = 5  # content type, legacy version, length
APPLICATION_DATA = 23


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("writes"), tls=True)
    yield running
    stop_server(running)


class RecordClient:
    """TLS 1.3 over a socket, through memory BIOs: what it reads is counted in records."""

    def __init__(self, server: Server) -> None:
        host, port = server.url.split("://")[1].split(":")
        assert server.ca_file is not None
        context = ssl.create_default_context(cafile=str(server.ca_file))
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)
        self.raw = b""  # received bytes not yet a whole record
        self.plain = b""  # decrypted bytes not yet handed out
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._receive_record()
        self._flush()

    def close(self) -> None:
        self.sock.close()

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.sock.sendall(data)

    def _receive_record(self) -> bool:
        """Feed one whole record to the TLS object; True if it carried application bytes."""
        while True:
            if len(self.raw) >= RECORD_HEADER:
                kind, _, length = struct.unpack("!BHH", self.raw[:RECORD_HEADER])
                if len(self.raw) >= RECORD_HEADER + length:
                    break
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.raw += chunk
        record, self.raw = self.raw[: RECORD_HEADER + length], self.raw[RECORD_HEADER + length :]
        self.incoming.write(record)
        before = len(self.plain)
        while True:
            try:
                data = self.tls.read(65536)
            except ssl.SSLWantReadError:
                break
            if not data:
                break
            self.plain += data
        return kind == APPLICATION_DATA and len(self.plain) > before

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def read_until(self, marker: bytes) -> int:
        """Records with application bytes received until ``marker`` is in the plaintext."""
        records = 0
        while marker not in self.plain:
            records += self._receive_record()
        return records

    def response(self, head_only: bool = False) -> tuple[int, bytes, bytes, int]:
        """The next answer (status, head, body) and the records it came in."""
        records = self.read_until(b"\r\n\r\n")
        head, _, rest = self.plain.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if head_only:
            length = 0
        self.plain = rest
        while len(self.plain) < length:
            records += self._receive_record()
        body, self.plain = self.plain[:length], self.plain[length:]
        return int(head.split(b" ", 2)[1]), head, body, records


def signed(
    server: Server, path: str, body: dict[str, object], expect: bool = False
) -> tuple[bytes, bytes]:
    content = orjson.dumps(body)
    headers = sign_request("POST", path, "", content, server.client_id, server.secret)
    lines = [f"POST {path} HTTP/1.1", "Host: cryptd", f"Content-Length: {len(content)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if expect:
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), content


@pytest.fixture
def client(tls_server: Server) -> Iterator[RecordClient]:
    opened = RecordClient(tls_server)
    # The first answer may share its reads with the session tickets sent after the handshake.
    opened.send(b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n")
    assert opened.response()[0] == 200
    yield opened
    opened.close()


def test_each_answer_is_one_tls_record(tls_server: Server, client: RecordClient) -> None:
    for _ in range(3):
        client.send(b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n")
        status, _, body, records = client.response()
        assert (status, records) == (200, 1)
        assert orjson.loads(body)["status"] == "ok"
    head, content = signed(tls_server, "/v1/encrypt/aes256-gcm", {"plaintext": "aGVsbG8="})
    client.send(head + content)
    status, _, body, records = client.response()
    assert (status, records) == (200, 1)
    assert orjson.loads(body)["ciphertext"].startswith("cryptd:v")
    # An error answer too.
    client.send(b"GET /v1/keys HTTP/1.1\r\nHost: cryptd\r\n\r\n")
    status, _, body, records = client.response()
    assert (status, records) == (401, 1)
    assert orjson.loads(body)["error"]["code"]


def test_head_answer_without_a_body_is_sent(client: RecordClient) -> None:
    client.send(b"HEAD /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n")
    status, head, body, records = client.response(head_only=True)
    assert (status, body, records) == (200, b"", 1)
    assert b"content-length: " in head.lower()
    # The connection goes on.
    client.send(b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n")
    assert client.response()[0] == 200


def test_100_continue_is_sent_before_the_body_arrives(
    tls_server: Server, client: RecordClient
) -> None:
    head, content = signed(tls_server, "/v1/encrypt/aes256-gcm", {"plaintext": "aGk="}, True)
    client.send(head)
    client.read_until(b"\r\n\r\n")  # times out (the socket's 10 s) if the interim answer waits
    interim, _, client.plain = client.plain.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue"
    client.send(content)
    status, _, body, records = client.response()
    assert (status, records) == (200, 1)
    assert "ciphertext" in orjson.loads(body)


def test_pipelined_requests_each_answered_whole(client: RecordClient) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n"
    client.send(request * 3 + b"HEAD /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n" + request)
    for head_only in (False, False, False, True, False):
        status, _, body, _ = client.response(head_only=head_only)
        assert status == 200
        assert (body == b"") is head_only


def test_answer_with_connection_close_is_sent_before_the_close(client: RecordClient) -> None:
    client.send(b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\nConnection: close\r\n\r\n")
    status, head, body, records = client.response()
    assert (status, records) == (200, 1)
    assert b"connection: close" in head.lower()
    assert orjson.loads(body)["status"] == "ok"


def test_plain_http_answers_unchanged(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        response = server.request("HEAD", "/healthz", sign=False)
        assert response.status_code == 200
        assert response.content == b""
        response = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": "aGk="})
        assert response.status_code == 200
        assert "ciphertext" in response.json()
    finally:
        stop_server(server)
