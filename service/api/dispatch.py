"""The crypto operations' single entry: ``POST /v1/{op}/{key}`` answered in one coroutine.

Every request used to pass five ASGI layers (timing, request id, body limit, signature check,
dispatch), each with its own pass over the headers, its own ``send`` or ``receive`` wrapper and
its own coroutine, before a Starlette ``Request`` was built to read the body again. A crypto
request needs none of that machinery: here it is matched with one split, its headers are read
in one pass, and the same parts those layers use do the same checks, in the same order, with
the same answers:

1. request id (the client's ``X-Request-ID`` when sane, else a fresh one), echoed on the answer;
2. body limit: 413 for a declared or actual body over ``max_body_bytes``;
3. signature, replay and rate limit (:meth:`SignatureAuthMiddleware.authenticate`): 401 / 429
   / 503;
4. event-loop lag: 503 ``overloaded`` while the loop runs late (service/pool/lag.py);
5. the operation (policy, body, crypto, audit): ``endpoint(scope, body, op, key)``;
6. timing for the metrics and the access log, once, whatever the outcome; an unexpected error is
   logged by type and answered 500.

Every other request (key management, health, the OpenAPI document, wrong methods) goes to
``app``: the same layers as ASGI middleware, then FastAPI. The routes stay declared in FastAPI,
so the OpenAPI document and the metrics' route labels are the same objects either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter
from typing import Any

from service.api.errors import send_cryptd_error
from service.asgi import ASGIApp, Receive, Scope, Send, request_id_of, route_path, send_error
from service.auth.middleware import REFUSED, WANTED_HEADERS, SignatureAuthMiddleware, add_field
from service.errors import CryptdError, Overloaded
from service.metrics.middleware import TimingMiddleware
from service.operations import OpName
from service.pool import InFlight

log = logging.getLogger("cryptd.api")

Endpoint = Callable[[Scope, bytes, OpName, str], Awaitable[bytes]]
"""endpoint(scope, body, operation, key) -> JSON body of the 200 answer; raises CryptdError
for the error model. ``scope["state"]["client"]`` is the authenticated client."""

_CONTENT_TYPE = (b"content-type", b"application/json")


class CryptoDispatch:
    def __init__(
        self,
        app: ASGIApp,
        *,
        endpoint: Endpoint,
        routes: Mapping[OpName, Any],
        auth: SignatureAuthMiddleware | None = None,
        max_body_bytes: int = 1024 * 1024,
        on_body_rejected: Callable[[str], None] | None = None,
        timing: TimingMiddleware | None = None,
        overloaded: Callable[[], bool] = lambda: False,
        on_overload: Callable[[], None] | None = None,
        cheap: InFlight | None = None,
        costly: Callable[[str], bool] = lambda key: False,
    ) -> None:
        """``app`` answers every other request. ``routes`` maps each operation to its FastAPI
        route (set as ``scope["route"]``; its path is the metrics' label). ``auth`` checks the
        signature (None: every crypto request is refused 401 by the endpoint's policy check);
        ``timing`` is the metrics and access-log recorder (None: neither is on). While
        ``overloaded()`` is true crypto requests are refused with 503 before any work;
        ``on_overload`` counts them, ``on_body_rejected("body_size")`` counts 413s. ``cheap``
        counts the requests in progress whose key is not ``costly(key)``: the ones costly
        work on the loop yields to (service/pool/sliced.py)."""
        self.app = app
        self.endpoint = endpoint
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.on_body_rejected = on_body_rejected
        self.timing = timing
        self.overloaded = overloaded
        self.on_overload = on_overload
        self.cheap = cheap
        self.costly = costly
        self.routes: dict[str, tuple[OpName, Any]] = {op: (op, r) for op, r in routes.items()}
        if not self.routes:
            raise ValueError("no crypto routes to dispatch")

    def match(self, scope: Scope) -> tuple[tuple[OpName, Any], str] | None:
        """((operation, route), key) for a crypto request, else None. ``scope["path"]`` is already
        percent-decoded, as FastAPI's router sees it; ``{key}`` matches one non-empty segment
        there too, so both always agree."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        parts = route_path(scope).split("/")
        if len(parts) == 4 and parts[0] == "" and parts[1] == "v1" and parts[3]:
            target = self.routes.get(parts[2])
            if target is not None:
                return target, parts[3]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = self.match(scope)
        if target is None:
            await self.app(scope, receive, send)
            return
        started = perf_counter()
        (operation, route), key = target
        scope["route"] = route
        scope["path_params"] = {"key": key}
        # One pass over the headers for every layer: request id, declared length, signature.
        request_id = b""
        declared = -1
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            wanted = WANTED_HEADERS.get(name) or WANTED_HEADERS.get(name.lower())
            if wanted is not None:
                add_field(headers, wanted, value)
            elif name == b"content-length":
                if declared < 0:
                    try:
                        declared = int(value)
                    except ValueError:
                        declared = 0
            elif name == b"x-request-id" and not request_id:
                request_id = value
        request_id = request_id_of(request_id)
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state["request_id"] = request_id.decode()
        status = 500  # what the server answers when nothing was sent
        response_started = False

        async def send_with_id(message: Any) -> None:
            # Error answers (413, 401, 503, the error model) keep their shape; they get the id.
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        cheap = self.cheap
        if cheap is not None and not self.costly(key):
            cheap.start()
        else:
            cheap = None
        try:
            body = await self._read_body(receive, declared, send_with_id)
            if body is None:
                return
            auth = self.auth
            if auth is not None:
                try:
                    await auth.authenticate(scope, headers, body)
                except REFUSED as exc:
                    await auth.refuse(exc, scope, send_with_id)
                    return
            if self.overloaded():
                if self.on_overload is not None:
                    self.on_overload()
                await send_cryptd_error(send_with_id, Overloaded("event loop overloaded"))
                return
            try:
                answer = await self.endpoint(scope, body, operation, key)
            except CryptdError as exc:
                await send_cryptd_error(send_with_id, exc)
                return
            status = 200
            response_started = True
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        _CONTENT_TYPE,
                        (b"content-length", str(len(answer)).encode()),
                        (b"x-request-id", request_id),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": answer})
        except Exception as exc:
            log.error(
                "request failed",
                extra={"error_type": type(exc).__name__, "request_id": state["request_id"]},
            )
            if not response_started:
                await send_error(send_with_id, 500, "internal", "internal error")
        finally:
            ended = perf_counter()
            if cheap is not None:
                cheap.end(ended)
            if self.timing is not None:
                self.timing.finish(scope, route.path, status, ended - started)

    async def _read_body(self, receive: Receive, declared: int, send: Send) -> bytes | None:
        """The whole body, or None once answered 413 or the client went away."""
        limit = self.max_body_bytes
        if declared > limit:
            await self._too_large(send)
            return None
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False) and len(body) <= limit:
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body", False) and size <= limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
        if size > limit:
            await self._too_large(send)
            return None
        return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        if self.on_body_rejected is not None:
            self.on_body_rejected("body_size")
        await send_error(
            send,
            413,
            "payload_too_large",
            f"request body exceeds {self.max_body_bytes} bytes",
            [(b"connection", b"close")],
        )
