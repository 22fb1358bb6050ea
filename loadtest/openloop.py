"""Open-loop load: requests start on a fixed schedule whatever the server does.

wrk is a closed loop (a connection sends its next request when the previous one is answered),
so a slow server gets fewer requests and its stalls hide (coordinated omission). Here request
``i`` is due at ``start + i / rate``; it takes an idle keep-alive connection or opens a new one,
and its latency runs from the *scheduled* time to the last byte of the answer, so time spent
waiting behind a stalled server counts. Every cryptd request is signed when it is sent (fresh
``created`` and nonce), so the signing cost is in the figures, as in the wrk scripts.

The HTTP/1.1 client is minimal on purpose (Content-Length or chunked answers, keep-alive):
httpx would spend more CPU per request than the server on these 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from loadtest.measure import Measurement
from loadtest.procstat import CpuWindow

MAX_CONNECTIONS: Final = 512
REQUEST_TIMEOUT: Final = 10.0
# Idle keep-alive connections older than this are not reused: servers close idle connections
# (uvicorn after 5 s) and a request written into a closing one would fail for nothing.
KEEPALIVE_EXPIRY: Final = 2.0

# The event loop's clock may tick in whole milliseconds (uvloop): time with perf_counter.
_now = time.perf_counter

RequestFactory = Callable[[], bytes]
"""Returns the complete bytes of the next request (called at send time)."""


def http_request(host: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Closed(Exception):
    """The server closed the connection (or answered ``Connection: close``)."""


class _Stale(_Closed):
    """Closed before any byte of an answer: the server had dropped the idle connection."""


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    last_used: float = 0.0

    async def exchange(self, data: bytes) -> tuple[int, bool]:
        """Send one request, read its whole answer; (status, keep the connection)."""
        self.writer.write(data)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise (_Stale if not exc.partial else _Closed) from exc
        except ConnectionError as exc:
            raise _Stale from exc
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            await self._skip_chunked()
        keep = headers.get("connection", "").lower() != "close"
        return status, keep

    async def _skip_chunked(self) -> None:
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await self.reader.readexactly(size + 2)
            if size == 0:
                return

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Stats:
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    send_lag: list[float] = field(default_factory=list)  # scheduled -> written, seconds
    statuses: dict[int, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    connections_opened: int = 0
    stale_retries: int = 0  # requests resent once because a reused connection had closed

    def fail(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (what wrk and HdrHistogram report)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


class OpenLoop:
    def __init__(
        self,
        url: str,
        make_request: RequestFactory,
        *,
        rate: float,
        duration: float,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{url}: need http://host:port")
        self.host, self.port = parts.hostname, parts.port
        self.make_request = make_request
        self.rate = rate
        self.duration = duration
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._stats = _Stats()

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._stats.connections_opened += 1
        return _Conn(reader, writer)

    def _take_idle(self) -> _Conn | None:
        now = _now()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.last_used < KEEPALIVE_EXPIRY:
                return conn
            conn.close()
        return None

    async def _one(self, due: float) -> None:
        stats = self._stats
        async with self._slots:
            conn = self._take_idle()
            reused = conn is not None
            try:
                async with asyncio.timeout(self.timeout - max(0.0, _now() - due)):
                    if conn is None:
                        conn = await self._connect()
                    data = self.make_request()
                    stats.send_lag.append(_now() - due)
                    try:
                        status, keep = await conn.exchange(data)
                    except _Stale:
                        if not reused:
                            raise
                        # What any HTTP client does: resend on a fresh connection (signed
                        # anew); the time lost stays in this request's latency.
                        conn.close()
                        stats.stale_retries += 1
                        conn = await self._connect()
                        status, keep = await conn.exchange(self.make_request())
            except TimeoutError:
                stats.fail("timeout")
                if conn is not None:
                    conn.close()
                return
            except (OSError, _Closed, ValueError, IndexError):
                stats.fail("connection")
                if conn is not None:
                    conn.close()
                return
            finished = _now()
            stats.statuses[status] = stats.statuses.get(status, 0) + 1
            if 200 <= status < 300:
                stats.latencies.append(finished - due)
            if keep:
                conn.last_used = finished
                self._idle.append(conn)
            else:
                conn.close()

    async def run(self, warm_connections: int = 16) -> Measurement:
        loop = asyncio.get_running_loop()
        for _ in range(warm_connections):
            conn = await self._connect()
            conn.last_used = _now()
            self._idle.append(conn)
        count = round(self.rate * self.duration)
        tasks: set[asyncio.Task[None]] = set()
        start = _now() + 0.05
        for i in range(count):
            due = start + i / self.rate
            delay = due - _now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(self._one(due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        elapsed = _now() - start
        for conn in self._idle:
            with contextlib.suppress(OSError):
                conn.close()
        return self._measurement(count, elapsed)

    def _measurement(self, count: int, elapsed: float) -> Measurement:
        stats = self._stats
        latencies = sorted(stats.latencies)
        lag = sorted(stats.send_lag)
        ok = len(latencies)
        errors = count - ok
        return Measurement(
            requests=ok,
            seconds=elapsed,
            errors=errors,
            p50_ms=_percentile(latencies, 50) * 1000,
            p99_ms=_percentile(latencies, 99) * 1000,
            mean_ms=(sum(latencies) / ok * 1000) if ok else float("nan"),
            max_ms=(latencies[-1] * 1000) if ok else float("nan"),
            detail={
                "offered_rate": self.rate,
                "scheduled": count,
                "p90_ms": _percentile(latencies, 90) * 1000,
                "p999_ms": _percentile(latencies, 99.9) * 1000,
                "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
                "failures": stats.failures,
                "connections_opened": stats.connections_opened,
                "stale_retries": stats.stale_retries,
                "send_lag_p50_ms": _percentile(lag, 50) * 1000,
                "send_lag_p99_ms": _percentile(lag, 99) * 1000,
            },
        )


def run_open_loop(
    url: str,
    make_request: RequestFactory,
    *,
    rate: float,
    duration: float,
    server_pid: int | Sequence[int] | None = None,
) -> Measurement:
    """Offer ``rate`` requests/s for ``duration`` seconds on a fresh event loop (uvloop when
    installed), with the CPU the server, this process and the rest of the machine spent."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    with runner, CpuWindow(server_pid, "self") as window:
        result = runner.run(OpenLoop(url, make_request, rate=rate, duration=duration).run())
    cpu = window.usage
    assert cpu is not None
    return dataclasses.replace(
        result, server_cpu_s=cpu.server, client_cpu_s=cpu.client, others_cpu_s=cpu.others
    )
