"""The parent's end of a worker channel: an asyncio protocol that cuts the stream into frames.

Reading never blocks the loop: the loop's own reader (epoll / libuv) tells us when bytes arrive
and we take what is there. Bytes go straight into a receive buffer (BufferedProtocol, no
intermediate ``bytes``); a frame larger than that buffer is read directly into a buffer of its own
size. Each complete payload is handed over as a memoryview valid only during the callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from service.pool.wire import HEADER, Kind, ProtocolError, header, parse_header

RECEIVE_BUFFER = 256 * 1024

FrameHandler = Callable[[Kind, int, memoryview], None]


class FrameProtocol(asyncio.BufferedProtocol):
    def __init__(self, on_frame: FrameHandler, on_lost: Callable[[], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._transport: asyncio.WriteTransport | None = None
        self._outbox: list[bytes] = []  # frames sent before the transport was connected
        self._buf = bytearray(RECEIVE_BUFFER)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received bytes
        self._big: bytearray | None = None  # payload of a frame larger than _buf
        self._big_filled = 0
        self._big_kind = Kind.RESULT
        self._big_id = 0
        self.closed = False

    # -- sending ----------------------------------------------------------------------------

    def send(self, kind: Kind, msg_id: int, payload: bytes) -> None:
        """Queue one frame; never blocks (the transport buffers what the socket cannot take)."""
        if self.closed:
            return
        head = header(kind, msg_id, len(payload))
        if self._transport is None:
            self._outbox += (head, payload)
        else:
            self._transport.writelines((head, payload))

    def close(self) -> None:
        """Flush what is queued, then close: the worker reads end of stream and exits."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.BufferedProtocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A Unix stream transport (uvloop's does not subclass asyncio.WriteTransport).
        self._transport = writer = cast(asyncio.WriteTransport, transport)
        if self.closed:
            writer.close()
        elif self._outbox:
            writer.writelines(self._outbox)
        self._outbox = []

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = None
        self._on_lost()

    def eof_received(self) -> bool:
        return False  # close our end too

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_filled :]
        if self._end == len(self._buf):
            self._compact()
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._big is not None:
                self._big_filled += nbytes
                if self._big_filled == len(self._big):
                    big, self._big = self._big, None
                    self._deliver(self._big_kind, self._big_id, memoryview(big))
                return
            self._end += nbytes
            self._parse()
        except ProtocolError:
            self.abort()  # a garbled stream: the worker is killed and replaced

    # -- framing ------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        while self._end - self._start >= HEADER.size:
            kind, msg_id, length = parse_header(buf, self._start)
            body = self._start + HEADER.size
            if self._end - body >= length:
                self._start = body + length
                self._deliver(kind, msg_id, memoryview(buf)[body : body + length])
                continue
            if HEADER.size + length > len(buf):
                # Too large for the receive buffer: read the rest into a buffer of its own.
                have = self._end - body
                self._big = bytearray(length)
                self._big[:have] = buf[body : self._end]
                self._big_filled = have
                self._big_kind, self._big_id = kind, msg_id
                self._start = self._end = 0
            break
        if self._start == self._end:
            self._start = self._end = 0

    def _compact(self) -> None:
        pending = self._end - self._start
        self._buf[:pending] = self._buf[self._start : self._end]
        self._start, self._end = 0, pending

    def _deliver(self, kind: Kind, msg_id: int, payload: memoryview) -> None:
        with payload:
            self._on_frame(kind, msg_id, payload)
