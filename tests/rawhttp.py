"""HTTP/1.1 on a raw socket, for tests that must control every byte on the wire (upgrade
offers, split packets, pipelining, malformed heads, slow senders)."""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass, field

import orjson


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    version: str = "HTTP/1.1"
    raw_headers: list[tuple[str, str]] = field(default_factory=list)

    def json(self) -> object:
        return orjson.loads(self.body)


def connect(
    url: str, *, timeout: float = 10.0, context: ssl.SSLContext | None = None
) -> socket.socket:
    """A connected socket to ``http://host:port`` (or ``https://`` with ``context``)."""
    scheme, _, rest = url.partition("://")
    host, _, port = rest.split("/", 1)[0].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    if scheme == "https":
        assert context is not None, "https needs an SSL context"
        return context.wrap_socket(sock, server_hostname=host)
    return sock


class ResponseReader:
    """Reads successive responses from one connection (Content-Length or chunked bodies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buffer += data
        return True

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            if not self._fill():
                raise ConnectionError(f"connection closed; buffered {self.buffer[:200]!r}")
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def _exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not self._fill():
                raise ConnectionError("connection closed inside a body")
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def read(self) -> RawResponse:
        head = self._until(b"\r\n\r\n").decode("latin-1")
        status_line, *lines = head.split("\r\n")
        version, status, *_ = status_line.split(" ")
        raw_headers = [
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(":") for line in lines)
        ]
        headers = dict(raw_headers)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self._until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    self._until(b"\r\n")
                    break
                body += self._exactly(size)
                self._exactly(2)
        else:
            body = self._exactly(int(headers.get("content-length", "0")))
        return RawResponse(int(status), headers, body, version, raw_headers)

    def closed(self, timeout: float = 5.0) -> bool:
        """True once the server has closed the connection (nothing more buffered)."""
        self.sock.settimeout(timeout)
        try:
            return not self._fill()
        except TimeoutError:
            return False
        except (ConnectionResetError, ssl.SSLError):
            return True


def exchange(
    url: str,
    chunks: list[bytes],
    responses: int = 1,
    *,
    pause: float = 0.0,
    context: ssl.SSLContext | None = None,
) -> list[RawResponse]:
    """Send ``chunks`` (one write each, ``pause`` seconds apart), then read ``responses``."""
    with connect(url, context=context) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index, chunk in enumerate(chunks):
            if index and pause:
                time.sleep(pause)
            sock.sendall(chunk)
        reader = ResponseReader(sock)
        return [reader.read() for _ in range(responses)]


def head_bytes(method: str, path: str, headers: dict[str, str], host: str = "cryptd") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
