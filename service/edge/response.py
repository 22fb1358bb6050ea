"""How cryptd's HTTP/1.1 protocol (protocol.py) writes its responses.

**A response leaves in one write**: uvicorn writes the status line and header fields when the
app sends ``http.response.start`` and the body when it sends ``http.response.body``, two
``transport.write`` calls: over TLS two records (two SSL_write calls, two AEAD seals) and on
any connection two sends. Here the response cycles write through the connection's
:class:`ResponseWriter`, which holds the head until the first body write (or the response's
end, for a HEAD answer without a body) and sends both together; every other write (``100
Continue``, later body parts) goes straight through.

**The common answer costs fewer instructions**, with the same bytes on the wire: the cycle is
an :class:`EdgeCycle`, whose ``send`` writes the head of a complete ``http.response.start``
with ``bytes`` header fields, lower-case names and a Content-Length (or no framing field at
all) itself, checked against the characters uvicorn refuses, with the server's default
fields (Date) joined once per change of the list uvicorn replaces every second; every other
answer, and every field uvicorn would refuse, goes through uvicorn's ``send``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

# Response header names the fast path has seen valid: lower-case, none of the characters
# uvicorn refuses, and no framing meaning (content-length, transfer-encoding, connection).
# Bounded, since apps choose the names; a name not in it is checked, or goes the slow way.
_PLAIN_NAMES: set[bytes] = set()
_PLAIN_NAMES_MAX = 256
_SPECIAL_NAMES = frozenset((b"content-length", b"transfer-encoding", b"connection"))
_search_name = HEADER_RE.search
_search_value = HEADER_VALUE_RE.search
# The server's default header fields (Date, Server, the configured ones) as one block: the
# list uvicorn replaces once a second, and its block (None: not plain, the slow way).
_defaults: tuple[list[tuple[bytes, bytes]] | None, bytes | None] = (None, None)


def _plain_name(name: bytes) -> bool:
    """Whether ``name`` may be written as it is with no meaning to the framing (learnt)."""
    if name in _PLAIN_NAMES:
        return True
    if _search_name(name) or name.lower() != name or name in _SPECIAL_NAMES:
        return False
    if len(_PLAIN_NAMES) < _PLAIN_NAMES_MAX:
        _PLAIN_NAMES.add(name)
    return True


def _defaults_block(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    global _defaults
    cached, block = _defaults
    if headers is not cached:
        block = _plain_block(headers)
        _defaults = (headers, block)
    return block


def _plain_block(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    parts: list[bytes] = []
    for name, value in headers:
        if type(name) is not bytes or type(value) is not bytes:
            return None
        if not _plain_name(name) or _search_value(value):
            return None
        parts += (name, b": ", value, b"\r\n")
    return b"".join(parts)


class EdgeCycle(RequestResponseCycle):
    """uvicorn's response cycle with a fast ``send`` for the common answer: a complete
    ``http.response.start`` whose header fields are ``bytes``, the names lower-case, with a
    Content-Length or none of the framing fields, without the access log. Its head is the
    bytes uvicorn writes, checked against the same characters uvicorn refuses; anything
    else (and any header uvicorn would refuse, so that the refusal is uvicorn's own) takes
    uvicorn's ``send``."""

    async def send(self, message: Any) -> None:
        if self.disconnected or self.flow.write_paused:
            await super().send(message)
            return
        if not self.response_started:
            if message["type"] == "http.response.start" and not self.access_log:
                head = self._head(message)
                if head is not None:
                    self.response_started = True
                    self.waiting_for_100_continue = False
                    self.transport.write(head)
                    return
        elif (
            not self.response_complete
            and message["type"] == "http.response.body"
            and not self.chunked_encoding
            and self.scope["method"] != "HEAD"
        ):
            body = message.get("body", b"")
            remaining = self.expected_content_length - len(body)
            if remaining < 0:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length = remaining
            self.transport.write(body)
            if not message.get("more_body", False):
                if remaining != 0:
                    raise RuntimeError("Response content shorter than Content-Length")
                self.response_complete = True
                self.message_event.set()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()
            return
        await super().send(message)

    async def receive(self) -> Any:
        # uvicorn's, without awaiting the event when it is set already (the body came with
        # the head, as it mostly does).
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            flow = self.flow
            if flow.read_paused:
                flow.resume_reading()
            event = self.message_event
            if not event.is_set():
                await event.wait()
            event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    def _head(self, message: Any) -> bytes | None:
        """The head uvicorn would write for ``message``, or None: uvicorn's ``send`` decides
        (nothing is changed before that)."""
        status = message.get("status")
        status_line = STATUS_LINE.get(status) if type(status) is int else None
        headers = message.get("headers", ())
        defaults = _defaults_block(self.default_headers)
        if status_line is None or defaults is None or type(headers) not in (list, tuple):
            return None
        parts = [status_line, defaults]
        length = -1
        try:
            for name, value in headers:
                if type(name) is not bytes or type(value) is not bytes:
                    return None
                if name == b"content-length" and length < 0:
                    if not value.isdigit():
                        return None
                    length = int(value)
                elif not _plain_name(name) or _search_value(value):
                    return None
                parts += (name, b": ", value, b"\r\n")
        except (TypeError, ValueError):  # not pairs
            return None
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        if length >= 0:
            self.expected_content_length = length
            self.chunked_encoding = False
        elif self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked_encoding = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


_JOIN_LIMIT = 64 * 1024  # a larger first body part goes out beside the head, not copied onto it


class ResponseWriter:
    """The connection's transport as its response cycles see it: the head a cycle writes on
    ``http.response.start`` is held and leaves with the first body part in one write (see the
    module's docstring). Responses on a connection are written one after another (uvicorn
    starts a pipelined request's cycle when the answer before it is complete), so one writer
    per connection holds at most one head. uvicorn calls only ``write``, ``close`` and
    ``is_closing`` on it."""

    __slots__ = ("_head", "_transport", "cycle")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None
        # The cycle being answered, until its head is written (then dropped, so that no
        # reference cycle outlives the response).
        self.cycle: RequestResponseCycle | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if len(data) <= _JOIN_LIMIT:
                self._transport.write(head + data)
            else:
                self._transport.writelines((head, data))
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            # What a cycle writes first once its response has started is the head (before
            # that only "100 Continue", which goes out at once).
            self.cycle = None
            self._head = data
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a head still held: the response ended without a body write (HEAD)."""
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()
