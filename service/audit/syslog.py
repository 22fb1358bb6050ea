"""The optional second sink: RFC 5424 messages over TCP (RFC 6587 octet counting).

It receives lines only once they are durable in the file, from a bounded queue its own thread
drains: a slow or absent syslog server costs it records (counted in ``dropped``, the file keeps
them all), never the file's writer or a request.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
from datetime import UTC, datetime

log = logging.getLogger("cryptd.audit")

_FACILITY_AUTHPRIV = 10
_SEVERITY_INFO = 6
_PRI = f"<{_FACILITY_AUTHPRIV * 8 + _SEVERITY_INFO}>"


def frame(line: bytes, *, hostname: str, pid: int, when: datetime | None = None) -> bytes:
    """One RFC 5424 message (no structured data, the record as MSG) with its octet count."""
    stamp = (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    header = f"{_PRI}1 {stamp} {hostname or '-'} cryptd {pid} audit - ".encode()
    message = header + line.rstrip(b"\n")
    return str(len(message)).encode() + b" " + message


class SyslogSink:
    def __init__(self, host: str, port: int, *, max_pending: int = 10_000) -> None:
        self.address = (host, port)
        self.dropped = 0
        self._pending: collections.deque[bytes] = collections.deque()
        self._max_pending = max_pending
        self._wake = threading.Event()
        self._closing = False
        self._hostname = socket.gethostname()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="cryptd-audit-syslog", daemon=True)
        self._thread.start()

    def send(self, lines: list[bytes]) -> None:
        room = self._max_pending - len(self._pending)
        if room < len(lines):
            self.dropped += len(lines) - max(room, 0)
            lines = lines[: max(room, 0)]
        self._pending.extend(lines)
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        pid = os.getpid()
        while not (self._closing and not self._pending):
            self._wake.wait(1.0)
            self._wake.clear()
            batch: list[bytes] = []
            while self._pending:
                batch.append(self._pending.popleft())
            if not batch:
                continue
            data = b"".join(frame(line, hostname=self._hostname, pid=pid) for line in batch)
            try:
                if self._socket is None:
                    self._socket = socket.create_connection(self.address, timeout=2.0)
                self._socket.sendall(data)
            except OSError as exc:
                self.dropped += len(batch)
                log.warning("audit syslog sink failed", extra={"error_type": type(exc).__name__})
                self._disconnect()
                if self._closing:
                    return
        self._disconnect()

    def _disconnect(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
            self._socket = None
