"""cryptd's HTTP/1.1 server protocol: uvicorn's httptools protocol with the edge rules.

Upgrade offers are ignored, as RFC 9110 section 7.8 allows: a request that offers
``Upgrade: h2c`` (Java's ``HttpClient`` on its defaults, ``curl --http2``), or any other
protocol, is answered as HTTP/1.1 with its body. httptools parses such a request's head, then
skips its body and stops, handing back the rest as "the other protocol" (httptools issue 124;
uvicorn issue 2722 is the same bug seen from uvicorn, which then hands the app an empty body:
the signature's digest fails and the caller sees 401). Here the rest of the bytes goes to a
fresh parser that reads the body with the request's own framing (Content-Length or chunked),
so llhttp, not new code, decides where the body ends; the connection then carries on as
keep-alive HTTP/1.1.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

_FRAMING = (b"content-length", b"transfer-encoding")


class EdgeProtocol(HttpToolsProtocol):
    """Pass as uvicorn's ``http`` class (with ``ws="none"``: cryptd has no WebSocket route, so
    every upgrade offer is one to ignore)."""

    # What a TLS listener offers in ALPN (uvicorn reads it too): HTTP/1.1 only.
    alpn_protocols: ClassVar[list[str]] = ["http/1.1"]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._upgrade_body: _UpgradeBody | None = None

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            while data:
                try:
                    self.parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as exc:
                    data = self._ignore_upgrade(data[exc.args[0] :])
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        body = self._upgrade_body
        if body is not None and body.between_messages:
            # The upgrade offer's body is read and no later request is half parsed: later
            # bytes go to a plain parser again, without the forwarding step.
            self._upgrade_body = None
            self.parser = self._new_parser(self)

    def _new_parser(self, target: object) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(target)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's own
        return parser

    def _ignore_upgrade(self, rest: bytes) -> bytes:
        """The parser stopped after the head of a request that offers an upgrade, and already
        reported the message complete with no body. Undo that: set up a parser that reads the
        body (whose bytes start ``rest``) as HTTP/1.1, then the requests after it; return the
        bytes to feed it."""
        framing = [(name, value) for name, value in self.headers if name in _FRAMING]
        if not framing:  # no body: ``rest`` is the next request
            self.parser = self._new_parser(self)
            return rest
        # The cycle's task has not run yet (this is still the same data_received call), so
        # the app never saw the empty body.
        self.cycle.more_body = True
        self.cycle.message_event.clear()
        body = self._upgrade_body = _UpgradeBody(self)
        self.parser = self._new_parser(body)
        # A stand-in head with the framing only; its head events are dropped.
        head = b"POST / HTTP/1.1\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in framing)
        return head + b"\r\n" + rest


class _UpgradeBody:
    """Parser callbacks while an ignored upgrade's body is read: the head events of the
    stand-in head are dropped, the body goes to the protocol, and everything after the body
    (a pipelined request) is forwarded unchanged."""

    __slots__ = ("between_messages", "done", "protocol")

    def __init__(self, protocol: EdgeProtocol) -> None:
        self.protocol = protocol
        self.done = False
        self.between_messages = False

    def on_message_begin(self) -> None:
        if self.done:
            self.between_messages = False
            self.protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self.done:
            self.protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.done:
            self.protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.done:
            self.protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self.protocol.on_body(body)

    def on_message_complete(self) -> None:
        self.protocol.on_message_complete()
        self.done = self.between_messages = True
