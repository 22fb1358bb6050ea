"""Idle keep-alive round trip: the check for the multi-worker TCP_NODELAY trap.

When accepted sockets lack TCP_NODELAY and the server writes an answer in two segments
(headers, then body), Nagle's algorithm holds the second until the first is acknowledged, and
the client delays that ACK by up to ~40 ms. On loopback a healthy keep-alive round trip is
well under a millisecond, so a median in the tens of milliseconds means the trap is sprung.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

TRAP_THRESHOLD_MS = 20.0


@dataclass(frozen=True)
class RoundTrip:
    path: str
    samples_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def trapped(self) -> bool:
        return self.median_ms > TRAP_THRESHOLD_MS


def _read_response(sock: socket.socket) -> int:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        body += chunk
    return status


def keepalive_round_trip(
    url: str,
    path: str,
    make_request: Callable[[], bytes],
    *,
    count: int = 20,
    idle: float = 0.02,
) -> RoundTrip:
    """Time ``count`` requests sent one at a time over ONE keep-alive connection, pausing
    ``idle`` seconds between them (an idle connection is where delayed ACKs bite)."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"{url}: need http://host:port")
    samples: list[float] = []
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            data = make_request()
            started = time.perf_counter()
            sock.sendall(data)
            status = _read_response(sock)
            samples.append((time.perf_counter() - started) * 1000)
            if not 200 <= status < 300:
                raise RuntimeError(f"{path}: status {status}")
            time.sleep(idle)
    # The first request of a connection pays no delayed ACK either way: keep the rest.
    return RoundTrip(path, samples[1:])


def get_request(host: str, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode("latin-1")
