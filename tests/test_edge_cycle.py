"""The edge's response cycle writes, byte for byte, what uvicorn's own writes: the same app
(tests/edge_cycle_app.py) is served by cryptd's EdgeProtocol and by uvicorn's plain httptools
protocol, each in its own process on a real socket, and the raw answers are compared. The
cases cover the fast head (bytes, lower-case names, Content-Length) and the answers that take
uvicorn's path (mixed-case or non-bytes names and values, no Content-Length, Connection
fields, HEAD, 1xx, 204/304, pipelining, HTTP/1.0), and the header names and values uvicorn
refuses, which both refuse alike."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.conftest import free_port
from tests.edge_cycle_app import BODY, CASES, LENGTH, REFUSED

pytestmark = pytest.mark.slow  # live servers: cryptd's and uvicorn's

_DATE = re.compile(rb"\r\ndate: [^\r]*\r\n")


class Running:
    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process, self.port = process, port


def _start(kind: str) -> Running:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.edge_cycle_app", kind, str(port)])
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Running(process, port)
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the {kind} server did not start") from None
            time.sleep(0.05)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Running, Running]]:
    edge = _start("edge")
    try:
        plain = _start("uvicorn")
    except BaseException:
        edge.process.kill()
        raise
    yield edge, plain
    for running in (edge, plain):
        running.process.terminate()
        running.process.wait(10)


def _read_response(sock: socket.socket, buffer: bytearray, method: str) -> bytes:
    """The raw bytes of one response (head and body), from ``buffer`` and the socket."""

    def fill() -> None:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buffer.extend(data)

    while b"\r\n\r\n" not in buffer:
        fill()
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end]).lower()
    status = int(head.split(b" ", 2)[1])
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        size = end
    elif b"\r\ntransfer-encoding: chunked\r\n" in head:
        while b"\r\n0\r\n\r\n" not in buffer[end - 2 :]:
            fill()
        size = buffer.index(b"\r\n0\r\n\r\n", end - 2) + 7
    else:
        found = re.search(rb"\r\ncontent-length: *(\d+)", head)
        size = end + (int(found.group(1)) if found else 0)
        while len(buffer) < size:
            fill()
    raw = bytes(buffer[:size])
    del buffer[:size]
    return raw


def _exchange(port: int, data: bytes, methods: list[str]) -> list[bytes]:
    """Send ``data`` in one write, read one response per method, then whether the server
    closed the connection (b"<closed>") or not."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        buffer = bytearray()
        answers = [_DATE.sub(b"\r\ndate: -\r\n", _read_response(sock, buffer, m)) for m in methods]
        sock.settimeout(0.3)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        except ConnectionResetError:
            closed = True
        answers.append(b"<closed>" if closed else b"<open>")
        return answers


def _request(path: str, method: str = "POST", extra: str = "", version: str = "1.1") -> bytes:
    body = b'{"plaintext":"QUFB"}' if method == "POST" else b""
    head = f"{method} {path} HTTP/{version}\r\nHost: cryptd\r\n{extra}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def both(servers: tuple[Running, Running], data: bytes, methods: list[str]) -> list[bytes]:
    edge, plain = servers
    answers = _exchange(edge.port, data, methods)
    assert answers == _exchange(plain.port, data, methods)
    return answers


@pytest.mark.parametrize("case", sorted(CASES))
def test_answers_are_uvicorns(servers: tuple[Running, Running], case: str) -> None:
    answers = both(servers, _request(f"/v1/{case}"), ["POST"])
    assert answers[0].startswith(b"HTTP/1.1 ")
    assert b"\r\ndate: -\r\nserver: uvicorn\r\n" in answers[0]
    assert answers[1] == (b"<closed>" if case == "connection-close" else b"<open>")


def test_fast_head_is_the_whole_answer(servers: tuple[Running, Running]) -> None:
    (answer, state) = both(servers, _request("/v1/plain"), ["POST"])
    assert (
        answer
        == (
            b"HTTP/1.1 200 OK\r\ndate: -\r\nserver: uvicorn\r\ncontent-type: application/json\r\n"
            b"content-length: " + LENGTH + b"\r\nx-request-id: 01JF3Q8W5M6Y7Z9A0B1C2D3E4F\r\n\r\n"
        )
        + BODY
    )
    assert state == b"<open>"
    # The edge wrote it on its fast path (which learnt the names), uvicorn on its own.
    edge, plain = (_exchange(s.port, _request("/names", "GET"), ["GET"])[0] for s in servers)
    learnt = edge.split(b"\r\n\r\n", 1)[1].split(b",")
    assert {b"content-type", b"date", b"server", b"x-request-id"} <= set(learnt)
    assert b"content-length" not in learnt  # framing fields are never plain
    assert plain.endswith(b"\r\n\r\n")


def test_mixed_case_names_come_out_lower_case(servers: tuple[Running, Running]) -> None:
    fast, _ = both(servers, _request("/v1/plain"), ["POST"])
    mixed, _ = both(servers, _request("/v1/mixed-case-names"), ["POST"])
    assert b"content-type: application/json\r\ncontent-length: " in mixed
    assert mixed.endswith(BODY)
    assert fast.endswith(BODY)


@pytest.mark.parametrize("case", ["plain", "no-length", "no-headers", "304"])
def test_head_requests(servers: tuple[Running, Running], case: str) -> None:
    answers = both(servers, _request(f"/v1/{case}", "HEAD"), ["HEAD"])
    assert answers[0].endswith(b"\r\n\r\n")
    assert answers[1] == b"<open>"


@pytest.mark.parametrize("case", ["plain", "no-length", "mixed-case-names"])
def test_closing_requests(servers: tuple[Running, Running], case: str) -> None:
    for data in (
        _request(f"/v1/{case}", extra="Connection: close\r\n"),
        _request(f"/v1/{case}", version="1.0"),
    ):
        answers = both(servers, data, ["POST"])
        assert b"\r\nconnection: close\r\n" in answers[0]
        assert answers[1] == b"<closed>"


def test_pipelined_requests(servers: tuple[Running, Running]) -> None:
    cases = ["plain", "mixed-case-names", "no-length", "204", "plain"]
    data = b"".join(_request(f"/v1/{case}") for case in cases)
    answers = both(servers, data, ["POST"] * len(cases))
    assert [a.split(b"\r\n", 1)[0] for a in answers[:-1]] == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 204 No Content",
        b"HTTP/1.1 200 OK",
    ]


def test_expect_100_continue(servers: tuple[Running, Running]) -> None:
    for server in servers:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            body = b'{"plaintext":"QUFB"}'
            sock.sendall(
                b"POST /v1/plain HTTP/1.1\r\nHost: cryptd\r\nExpect: 100-continue\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            buffer = bytearray()
            assert _read_response(sock, buffer, "POST") == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(body)
            answer = _read_response(sock, buffer, "POST")
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
            assert answer.endswith(BODY)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_fields_are_refused_alike(servers: tuple[Running, Running], case: str) -> None:
    for server in servers:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(_request(f"/v1/{case}"))
            # Nothing of the refused head leaves; the connection is closed.
            assert sock.recv(65536) == b""
    errors = [_exchange(s.port, _request(f"/errors/{case}", "GET"), ["GET"])[0] for s in servers]
    assert errors[0] == errors[1]
    expected = b"ValueError" if case == "bad-length" else b"RuntimeError('Invalid HTTP header"
    assert errors[0].split(b"\r\n\r\n", 1)[1].startswith(expected)


def test_server_keeps_serving_after_refusals(servers: tuple[Running, Running]) -> None:
    both(servers, _request("/v1/crlf-in-value"), [])
    answers = both(servers, _request("/v1/plain") * 2, ["POST", "POST"])
    assert answers[0] == answers[1]
    assert answers[2] == b"<open>"
