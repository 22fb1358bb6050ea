"""The HTTP edge against a real server: header size limit (431), read timeouts (408, idle
close), slowloris, malformed HTTP in the JSON error shape with X-Request-ID."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import httpx
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.rawhttp import RawResponse, ResponseReader, connect, exchange, head_bytes

pytestmark = pytest.mark.slow  # live servers, waits out the read timeouts

LIMIT = 16 * 1024  # the default CRYPTD_MAX_HEADER_BYTES


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


def assert_json_error(response: RawResponse, status: int, code: str) -> None:
    assert response.status == status, response.body
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert isinstance(body, dict)
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert set(body["error"]) == {"code", "message"}
    assert len(response.headers["x-request-id"]) >= 8
    assert response.headers["connection"] == "close"


def rejections(server: Server, cause: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("cryptd_rejections_total{") and f'cause="{cause}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- header size ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [100 * 1024, 1024 * 1024, 8 * 1024 * 1024])
def test_large_head_is_431_and_the_server_keeps_serving(server: Server, size: int) -> None:
    before = rejections(server, "header_size")
    head = head_bytes("GET", "/healthz", {"X-Request-ID": "big-head-1", "X-Big": "a" * size})
    with connect(server.url) as sock:
        started = time.monotonic()
        # Refused before all of it was sent: the answer is already waiting.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        response = ResponseReader(sock).read()
        assert time.monotonic() - started < 5
    assert_json_error(response, 431, "headers_too_large")
    assert response.headers["x-request-id"] == "big-head-1"  # parsed before the big field
    assert rejections(server, "header_size") == before + 1
    assert server.request("GET", "/healthz", sign=False).status_code == 200


def test_head_over_the_limit_in_one_read_is_431(server: Server) -> None:
    # Just over the limit, sent in one write: the head completes within one read, so it is
    # measured from its parsed fields.
    head = head_bytes("GET", "/healthz", {"X-Big": "a" * (LIMIT + 100)})
    assert len(head) < 64 * 1024
    (response,) = exchange(server.url, [head])
    assert_json_error(response, 431, "headers_too_large")


def test_head_under_the_limit_is_served(server: Server) -> None:
    # Many fields, the whole just under the limit, split across several writes.
    fields = {f"X-Field-{i}": "v" * 100 for i in range(140)}
    head = head_bytes("GET", "/healthz", fields)
    assert LIMIT - 2048 < len(head) < LIMIT
    chunks = [head[i : i + 3000] for i in range(0, len(head), 3000)]
    (response,) = exchange(server.url, chunks, pause=0.01)
    assert response.status == 200


def test_big_body_with_small_head_in_one_read_is_not_431(server: Server) -> None:
    """A read holding a small head and a body larger than the head limit is a normal request."""
    body = b'{"plaintext":"' + b"A" * 200_000 + b'"}'
    response = server.request("POST", "/v1/encrypt/aes256-gcm", raw=body)
    assert response.status_code == 200, response.text


# --- time limits -------------------------------------------------------------------------


def test_connection_that_sends_nothing_is_closed(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_HEADER_READ_TIMEOUT="1")
    with connect(server.url) as sock:
        started = time.monotonic()
        assert ResponseReader(sock).closed(timeout=10)
        assert 0.8 < time.monotonic() - started < 5


def test_slow_head_is_408_and_idle_keep_alive_is_closed(own_server: Callable[..., Server]) -> None:
    # The keep-alive limit longer than the head's: each holds.
    server = own_server(CRYPTD_HEADER_READ_TIMEOUT="1.5", CRYPTD_KEEPALIVE_TIMEOUT="3")
    with connect(server.url) as sock:
        reader = ResponseReader(sock)
        sock.sendall(head_bytes("GET", "/healthz", {}))
        assert reader.read().status == 200
        # kept alive, then the next head dribbles in: cut off 1.5 s after its first byte
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        sock.settimeout(0.4)
        response = None
        while response is None and time.monotonic() - started < 6:
            try:
                response = reader.read()
            except TimeoutError:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X-Slow: 1\r\n")
        assert response is not None
        assert_json_error(response, 408, "request_timeout")
        assert 1.3 < time.monotonic() - started < 4
    with connect(server.url) as sock:
        reader = ResponseReader(sock)
        sock.sendall(head_bytes("GET", "/healthz", {}))
        assert reader.read().status == 200
        started = time.monotonic()
        assert reader.closed(timeout=10)  # idle: closed after the keep-alive timeout
        assert 2.8 < time.monotonic() - started < 5


def test_idle_keep_alive_counts_from_the_last_response(own_server: Callable[..., Server]) -> None:
    # The connection's timer, armed before the first response, is kept across responses: the
    # idle limit still runs from the end of the last one.
    server = own_server(CRYPTD_HEADER_READ_TIMEOUT="1.5", CRYPTD_KEEPALIVE_TIMEOUT="3")
    with connect(server.url) as sock:
        reader = ResponseReader(sock)
        for pause in (0.0, 1.0, 1.0):
            time.sleep(pause)
            sock.sendall(head_bytes("GET", "/healthz", {}))
            assert reader.read().status == 200
        started = time.monotonic()
        assert reader.closed(timeout=10)
        assert 2.8 < time.monotonic() - started < 5


@pytest.mark.parametrize("complete", [1, 2])
def test_pipelined_partial_head_is_bounded_by_the_header_timeout(
    own_server: Callable[..., Server], complete: int
) -> None:
    """A head that begins in the read of the request(s) before it, on a kept-alive
    connection, then dribbles in: 408 within the header timeout of its first byte (the idle
    and request limits are longer, so neither could be what closes it)."""
    server = own_server(
        CRYPTD_HEADER_READ_TIMEOUT="1.5",
        CRYPTD_KEEPALIVE_TIMEOUT="20",
        CRYPTD_REQUEST_READ_TIMEOUT="20",
    )
    with connect(server.url) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = ResponseReader(sock)
        # One write: the complete request(s), then the first line of the next head.
        sock.sendall(head_bytes("GET", "/healthz", {}) * complete + b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        for _ in range(complete):
            assert reader.read().status == 200
        sock.settimeout(0.4)
        response = None
        while response is None and time.monotonic() - started < 8:
            try:
                response = reader.read()
            except TimeoutError:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X-Slow: 1\r\n")
        assert response is not None
        assert_json_error(response, 408, "request_timeout")
        assert 1.3 < time.monotonic() - started < 4
        assert reader.closed(timeout=5)
    assert server.request("GET", "/healthz", sign=False).status_code == 200


def test_pipelined_head_over_the_limit_is_431(server: Server) -> None:
    """The head's bytes that came in the previous request's read count too: a head that
    begins there and ends over the limit in a later read is 431."""
    first = head_bytes("GET", "/healthz", {}) + b"GET /healthz HTTP/1.1\r\nX-Big: "
    first += b"a" * (LIMIT - 1000)
    rest = b"a" * 2000 + b"\r\n\r\n"
    responses = exchange(server.url, [first, rest], responses=2, pause=0.3)
    assert responses[0].status == 200
    assert_json_error(responses[1], 431, "headers_too_large")
    # Under the limit the same split is served.
    first = head_bytes("GET", "/healthz", {}) + b"GET /healthz HTTP/1.1\r\nX-Big: "
    first += b"a" * (LIMIT - 3000)
    rest = b"a" * 1000 + b"\r\n\r\n"
    responses = exchange(server.url, [first, rest], responses=2, pause=0.3)
    assert [r.status for r in responses] == [200, 200]


def test_slow_body_is_408(own_server: Callable[..., Server]) -> None:
    server = own_server(CRYPTD_REQUEST_READ_TIMEOUT="2")
    headers = {"Content-Type": "application/json", "Content-Length": "100"}
    with connect(server.url) as sock:
        sock.sendall(head_bytes("POST", "/v1/encrypt/aes256-gcm", headers) + b'{"plain')
        started = time.monotonic()
        response = ResponseReader(sock).read()
        assert_json_error(response, 408, "request_timeout")
        assert 1.5 < time.monotonic() - started < 5
    assert server.request("GET", "/healthz", sign=False).status_code == 200


def test_slowloris_is_cut_off_while_others_are_served(own_server: Callable[..., Server]) -> None:
    """1,000 connections each sending a header line every 2 s (the default 5 s header
    timeout): all closed within 10 s, while a probe's signed requests keep getting 200."""
    server = own_server()
    count = 1000
    probe_statuses: list[int] = []
    probe_latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    status = client.get(server.url + "/healthz").status_code
                    signed = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""})
                    status = max(status, signed.status_code)
                except httpx.HTTPError:
                    status = 0
                probe_statuses.append(status)
                probe_latencies.append(time.monotonic() - started)
                time.sleep(0.1)

    selector = selectors.DefaultSelector()
    sockets: list[socket.socket] = []
    closed_at: dict[int, float] = {}
    host, port = server.url.removeprefix("http://").split(":")
    thread = threading.Thread(target=probe, daemon=True)
    try:
        for _ in range(count):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\n")
            sock.setblocking(False)
            sockets.append(sock)
            selector.register(sock, selectors.EVENT_READ)
        opened = time.monotonic()
        thread.start()
        next_line = opened + 2
        while len(closed_at) < count and time.monotonic() - opened < 20:
            for key, _ in selector.select(timeout=0.2):
                sock = cast(socket.socket, key.fileobj)  # the selector holds only sockets
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data or b"\r\n\r\n" in data:
                    closed_at[sock.fileno()] = time.monotonic() - opened
                    selector.unregister(sock)
            if time.monotonic() >= next_line:
                next_line += 2
                for sock in sockets:
                    if sock.fileno() not in closed_at:
                        with contextlib.suppress(OSError):
                            sock.send(b"X-Slow: 1\r\n")
        stop.set()
        thread.join(timeout=10)
    finally:
        stop.set()
        selector.close()
        for sock in sockets:
            sock.close()
    assert len(closed_at) == count, f"{count - len(closed_at)} slow connections still open"
    assert max(closed_at.values()) < 10, max(closed_at.values())
    assert probe_statuses, "the probe made no request"
    assert set(probe_statuses) == {200}, probe_statuses
    assert len(probe_statuses) >= 10


# --- malformed HTTP ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nBad Header: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nX-A: \x01\r\n\r\n",
        b"POST /v1/encrypt/aes256-gcm HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v1/encrypt/k HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ],
    ids=["request-line", "version", "header-name", "header-value", "chunk", "two-lengths", "h2"],
)
def test_malformed_http_gets_the_json_error(server: Server, raw: bytes) -> None:
    (response,) = exchange(server.url, [raw])
    assert_json_error(response, 400, "invalid_request")
    assert server.request("GET", "/healthz", sign=False).status_code == 200


def test_malformed_header_after_request_id_echoes_it(server: Server) -> None:
    raw = b"GET /healthz HTTP/1.1\r\nX-Request-ID: trace-42\r\nHost: x\r\nBad Header: y\r\n\r\n"
    (response,) = exchange(server.url, [raw])
    assert_json_error(response, 400, "invalid_request")
    assert response.headers["x-request-id"] == "trace-42"


def test_refusals_are_counted_and_logged_without_content(server: Server) -> None:
    before = rejections(server, "malformed_http")
    exchange(server.url, [b"GET /healthz HTTP/1.1\r\nX-Secret-Marker-91c: \x01\r\n\r\n"])
    assert rejections(server, "malformed_http") == before + 1
    assert "X-Secret-Marker-91c" not in server.log()
    assert "request refused at the HTTP edge" in server.log()
