"""cryptd's HTTP/1.1 server protocol: uvicorn's httptools protocol with the edge rules.

**Upgrade offers are ignored**, as RFC 9110 section 7.8 allows: a request that offers
``Upgrade: h2c`` (Java's ``HttpClient`` on its defaults, ``curl --http2``), or any other
protocol, is answered as HTTP/1.1 with its body. httptools parses such a request's head, then
skips its body and stops, handing back the rest as "the other protocol" (httptools issue 124;
uvicorn issue 2722 is the same bug seen from uvicorn, which then hands the app an empty body:
the signature's digest fails and the caller sees 401). Here the rest of the bytes goes to a
fresh parser that reads the body with the request's own framing (Content-Length or chunked),
so llhttp, not new code, decides where the body ends; the connection then carries on as
keep-alive HTTP/1.1.

**The request head is bounded**: more than ``max_header_bytes`` of request line and header
fields is 431 ``headers_too_large``. While a head is incomplete every byte received counts
(so a huge or endless head is cut off as soon as it passes the limit, holding at most the
limit plus one read); a head that completes within one read is measured from its parsed
fields, and only when that read was larger than the limit. A pipelined head that begins in
the read where the request before it ended (how many of that read's bytes are its own, the
parser does not say) is measured from its parsed fields when it completes; until then the
bytes of its later reads count, so it too holds at most the limit plus one read.

**Time limits**, on one timer per connection (uvicorn's keep-alive timer, so a request costs
no more timer operations than before): a new connection, or a kept-alive one from the first
byte of its next request, must deliver the complete head within ``header_timeout`` seconds,
and the whole request within ``request_timeout``, else 408 ``request_timeout`` and the
connection is closed; an idle kept-alive connection is closed after ``timeout_keep_alive``
(uvicorn's setting). The timer runs in steps no longer than the shortest of the three and
re-arms itself for what remains, so each limit holds whatever the others are. A slowloris
client (a header line every few seconds) is cut off after ``header_timeout`` whatever it
sends, while other connections are served.

**Malformed HTTP** (request line, header syntax, chunked framing) gets the JSON error shape,
400 ``invalid_request``, with an ``X-Request-ID`` (the client's, if its header was parsed).
These refusals close the connection and are counted through the lifespan state's
:data:`REJECTION_HOOK`, if the app put one there.

**TLS connections** carry the ASGI TLS extension (``scope["extensions"]["tls"]``), built once
per connection.

**Responses** are written by :mod:`service.edge.response` (one write per response, a fast
path for the common answer). A connection's last request target is parsed once for the
requests that repeat it, and the connection's timer is kept across responses when it is due
within a step anyway (instead of being cancelled and armed again after each one, as uvicorn
does).

**Shutdown drains idle connections** instead of closing them at once (uvicorn closes an idle
kept-alive connection when the server stops, and a request whose bytes sat unread in its
socket, the loop busy with others, is then cut off with a reset). An idle connection is
given ``DRAIN_GRACE``: a request that arrives meanwhile, or was already waiting unread, is
answered with ``connection: close``. After that the connection is half-closed and what the
client still sends is read and dropped until it closes its end (at most ``DRAIN_LINGER``), so
a client that sent a request as the server stopped meets a clean EOF, never a reset (nginx's
``lingering_close``). A request being answered is finished; a response whose head already
went out keep-alive is followed by the same drain. TLS connections cannot be half-closed:
they are closed once nothing unread is waiting. None of this costs a request anything before
the server stops.

The protocol is one class over uvicorn's, its request-side parser callbacks, limits and
refusals and shutdown together, since each of them changes how the others read the same
parser state and timer; hence over 400 lines.
"""

from __future__ import annotations

import asyncio
import logging
import select
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from service.asgi import error_body, request_id
from service.edge.response import EdgeCycle, ResponseWriter
from service.edge.tls import ALPN, asgi_tls_extension

log = logging.getLogger("cryptd.edge")

REJECTION_HOOK = "cryptd.edge.rejected"
"""Lifespan-state key of a ``callable(cause)`` told of every refusal made here (metrics):
causes ``header_size`` (431), ``read_timeout`` (408), ``malformed_http`` (400)."""

_Refusal = tuple[int, str, str, str]  # status, code, message, cause

DRAIN_GRACE = 0.25
"""Seconds an idle connection is kept open when the server stops, for a request on its way
(across a network, or the next one of a client just answered)."""
DRAIN_LINGER = 1.0
"""Seconds a half-closed connection is read (and the bytes dropped) before it is closed, when
the client does not close its end first: bytes it sent before it saw the EOF arrive in time."""
_RECHECK = 0.01  # seconds until a draining connection with unread bytes is looked at again

_FRAMING = (b"content-length", b"transfer-encoding")
_MALFORMED: _Refusal = (400, "invalid_request", "malformed HTTP request", "malformed_http")
# Where the parser is in the current request.
_BETWEEN, _HEAD, _BODY = 0, 1, 2


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int = 16 * 1024
    header_timeout: float = 5.0
    request_timeout: float = 30.0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal is in ``_refusal``."""


class _Discard:
    """Stands in for the parser once a connection is being closed: later bytes are dropped."""

    def feed_data(self, data: bytes) -> None:
        return None


class EdgeProtocol(HttpToolsProtocol):
    """Pass as uvicorn's ``http`` class (with ``ws="none"``: cryptd has no WebSocket route, so
    every upgrade offer is one to ignore); the limits come from ``config.edge`` (an
    :class:`EdgeLimits`, see service/edge/server.py), else the defaults."""

    # What a TLS listener offers in ALPN (uvicorn reads it too): HTTP/1.1 only.
    alpn_protocols: ClassVar[list[str]] = ALPN
    # The server is stopping: set on the connection by shutdown() (a class default, so that
    # opening a connection costs nothing more).
    _draining = False

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = getattr(config, "edge", None) or EdgeLimits()
        self._max_head = limits.max_header_bytes
        self._header_timeout = limits.header_timeout
        self._request_timeout = limits.request_timeout
        self._on_refusal: Callable[[str], None] | None = app_state.get(REJECTION_HOOK)
        # uvicorn arms its keep-alive timer with timeout_keep_alive after each response: the
        # step; the idle limit itself is kept here.
        self._keep_alive = float(self.timeout_keep_alive)
        self._step = min(self._keep_alive, self._header_timeout, self._request_timeout)
        self.timeout_keep_alive = self._step  # type: ignore[assignment]
        self._idle_deadline: float | None = None  # loop time an idle connection is closed at
        self._phase = _BETWEEN
        self._started = 0.0  # loop time of the current request's first byte
        self._head_bytes = 0  # bytes of the current head received in earlier reads
        self._read = 0  # size of the read being parsed
        self._ended = False  # a message ended inside the read being parsed
        # The current head began in a read where an earlier message ended (pipelining): its
        # bytes in that read were not counted, so its parsed size is checked when it completes.
        self._uncounted = False
        self._refusal: _Refusal | None = None
        self._extensions: dict[str, Any] | None = None
        self._upgrade_body: _UpgradeBody | None = None
        self._writer: ResponseWriter | None = None  # made with the first request's cycle
        # The last request target parsed, and its path, raw path and query string.
        self._target_url: bytes | None = None
        self._target: tuple[str, bytes, bytes] = ("", b"", b"")

    # --- connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self._extensions = {"tls": asgi_tls_extension(ssl_object)}
        # The first request's head is due within header_timeout of the connection's opening.
        self._idle_deadline = self.loop.time() + self._header_timeout
        self.timeout_keep_alive_task = self.loop.call_later(
            self._step, self.timeout_keep_alive_handler
        )

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # The cycle's task has not run yet: it writes its whole answer through the writer.
        writer = self._writer
        if writer is None:
            writer = self._writer = ResponseWriter(self.transport)
        writer.cycle = cycle
        cycle.transport = writer  # type: ignore[assignment]
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        # uvicorn's, but with the held head sent first, and the timer kept when it is due
        # within a step anyway (uvicorn cancels it and arms a new one after every response):
        # the idle deadline is set here, and the handler re-arms itself for what remains.
        if self._writer is not None:
            self._writer.flush()
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._unset_keepalive_if_required()
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        now = self.loop.time()
        self._idle_deadline = now + self._keep_alive
        timer = self.timeout_keep_alive_task
        if timer is None or timer.when() > now + self._step:
            self._unset_keepalive_if_required()
            self._rearm(self._step)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        # Unlike uvicorn's, no timer is cancelled here: the same timer bounds the head.
        self._read = len(data)
        self._ended = False
        try:
            while data:
                try:
                    self.parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as exc:
                    data = self._ignore_upgrade(data[exc.args[0] :])
        except httptools.HttpParserError:
            self._refuse(*(self._refusal or _MALFORMED))
            return
        if self._phase == _HEAD and not self._ended:
            # The whole read belongs to a head that is still incomplete.
            self._head_bytes += self._read
            if self._head_bytes > self._max_head:
                self._refuse(*self._too_large())
                return
        body = self._upgrade_body
        if body is not None and body.between_messages:
            # The upgrade offer's body is read and no later request is half parsed: later
            # bytes go to a plain parser again, without the forwarding step.
            self._upgrade_body = None
            self.parser = self._new_parser(self)

    def timeout_keep_alive_handler(self) -> None:
        """The connection's one timer: idle keep-alive, head and request deadlines."""
        self.timeout_keep_alive_task = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._phase == _BETWEEN:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being answered; its response arms the timer again
            if self._idle_deadline is None:  # not set: idle since the timer was armed
                self._idle_deadline = now - self._step + self._keep_alive
            if now >= self._idle_deadline - 0.001:
                if self._draining:
                    self._close_drained()
                else:
                    self.transport.close()  # idle
            else:
                self._rearm(self._idle_deadline - now)
            return
        limit = self._header_timeout if self._phase == _HEAD else self._request_timeout
        remaining = self._started + limit - now
        if remaining > 0.001:
            self._rearm(remaining)
            return
        what = "request head" if self._phase == _HEAD else "request"
        message = f"{what} not received within {limit:g} s"
        self._refuse(408, "request_timeout", message, "read_timeout")

    def _rearm(self, delay: float) -> None:
        self.timeout_keep_alive_task = self.loop.call_later(delay, self.timeout_keep_alive_handler)

    # --- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Called by the server on every connection when it stops: see the module's docstring
        (uvicorn's closes an idle connection at once)."""
        if self._draining:
            return
        self._draining = True
        # Every request started from now on is the connection's last. Set on the instance, so
        # that no request pays for the check before the server stops.
        self._start_asgi_task = self._start_last_task  # type: ignore[method-assign]
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self.pipeline:
                # Its head went out keep-alive, or requests wait behind it: once it is
                # answered, the connection drains as an idle one.
                cycle.on_response = self._drain_after_response
            else:
                cycle.keep_alive = False  # answered with connection: close, then closed
        elif self._phase == _BETWEEN:
            self._drain_idle()
        # Else a request is arriving: it is answered with connection: close, in its limits.

    def _start_last_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.keep_alive = False
        EdgeProtocol._start_asgi_task(self, cycle, app)

    def _drain_after_response(self) -> None:
        self.on_response_complete()
        cycle = self.cycle
        closing = self.transport.is_closing()
        if not closing and cycle.response_complete and self._phase == _BETWEEN:
            self._drain_idle()

    def _drain_idle(self) -> None:
        self._unset_keepalive_if_required()
        self._idle_deadline = self.loop.time() + DRAIN_GRACE
        self._rearm(DRAIN_GRACE)

    def _close_drained(self) -> None:
        """The end of an idle connection's grace: close it, unless bytes are waiting unread."""
        transport = self.transport
        if transport.is_reading() and _unread(transport):
            # The loop has not read them yet (busy with others): a request among them is
            # answered; the client's EOF closes the connection.
            self._rearm(_RECHECK)
            return
        self.parser = _Discard()  # type: ignore[assignment]
        if transport.can_write_eof():
            # Half-closed: the client reads EOF; what it sends before it sees that is read
            # and dropped (closing a socket with unread bytes would send a reset).
            transport.write_eof()
            self.timeout_keep_alive_task = self.loop.call_later(DRAIN_LINGER, transport.close)
        else:
            transport.close()

    # --- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # uvicorn's, inline.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        self._phase = _HEAD
        self._uncounted = self._ended
        self._started = self.loop.time()
        self._idle_deadline = None
        if self._extensions is not None:
            self.scope["extensions"] = self._extensions

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        received = self._head_bytes + self._read  # this head's size, unless _uncounted
        self._head_bytes = 0
        if (received > self._max_head or self._uncounted) and self._head_size() > self._max_head:
            self._refusal = self._too_large()
            raise _Refused
        # uvicorn's own, but the cycle is an EdgeCycle.
        parser = self.parser
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        if parser.should_upgrade() and self._should_upgrade():
            return
        url = self.url
        if url != self._target_url:  # a connection's requests mostly go to one target
            self._target_url = url
            self._target = self._parse_target(url)
        scope["path"], scope["raw_path"], scope["query_string"] = self._target
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        else:
            app = self.app
        existing_cycle = self.cycle
        cycle = self.cycle = EdgeCycle(
            scope,
            self.transport,
            self.flow,
            self.logger,
            self.access_logger,
            self.access_log,
            self.server_state.default_headers,
            asyncio.Event(),
            self.expect_100_continue,
            http_version != "1.0" and parser.should_keep_alive(),
            self.on_response_complete,
        )
        if existing_cycle is None or existing_cycle.response_complete:
            self._start_asgi_task(cycle, app)
        else:
            # Pipelined requests wait for the answer before them.
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))

    def _parse_target(self, url: bytes) -> tuple[str, bytes, bytes]:
        """The scope's path, raw path and query string for a request target, as uvicorn's."""
        parsed_url = httptools.parse_url(url)
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root_path = self.root_path
        return root_path + path, root_path.encode("ascii") + raw_path, parsed_url.query or b""

    def on_message_complete(self) -> None:
        # uvicorn's, inline.
        cycle = self.cycle
        if not cycle.response_complete and not (
            self.parser.should_upgrade() and self._should_upgrade()
        ):
            cycle.more_body = False
            cycle.message_event.set()
        self._phase = _BETWEEN
        self._ended = True

    # --- refusals --------------------------------------------------------------------------

    def _head_size(self) -> int:
        """The parsed head's size on the wire (request line, fields, line ends)."""
        size = len(self.url) + 16
        for name, value in self.headers:
            size += len(name) + len(value) + 4
        return size

    def _too_large(self) -> _Refusal:
        message = f"request head exceeds {self._max_head} bytes"
        return 431, "headers_too_large", message, "header_size"

    def _refuse(self, status: int, code: str, message: str, cause: str) -> None:
        """Answer ``status`` with the JSON error body and close the connection."""
        self._refusal = None
        self._phase = _BETWEEN
        self.parser = _Discard()  # type: ignore[assignment]
        if self._on_refusal is not None:
            self._on_refusal(cause)
        peer = self.client[0] if self.client else "-"
        log.info("request refused at the HTTP edge: %s (peer=%s)", code, peer)
        cycle = self.cycle
        if (
            cycle is not None
            and not cycle.response_complete
            and (cycle.response_started or not cycle.more_body)
        ):
            # An earlier request is being answered: let that answer finish, then close.
            cycle.keep_alive = False
            self.transport.pause_reading()
            return
        body = error_body(code, message)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        content += [
            b"content-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nx-request-id: ",
            request_id(self.headers or ()),
            b"\r\nconnection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(content))
        self.transport.close()

    # --- ignored upgrades ------------------------------------------------------------------

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
        self._phase = _BODY
        body = self._upgrade_body = _UpgradeBody(self)
        self.parser = self._new_parser(body)
        # A stand-in head with the framing only; its head events are dropped.
        head = b"POST / HTTP/1.1\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in framing)
        return head + b"\r\n" + rest


def _unread(transport: asyncio.Transport) -> bool:
    """Whether the transport's socket holds bytes (or the peer's EOF) not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


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
