"""Edge middleware (pure ASGI): request ids, the last line of defence against unexpected
errors, and the body-size limit."""

from __future__ import annotations

import logging
from collections.abc import Callable

from service.asgi import ASGIApp, Message, Receive, Scope, Send, request_id, send_error

log = logging.getLogger("cryptd.api")


class RequestIdMiddleware:
    """Echo a sane ``X-Request-ID`` or make one; put it in ``scope["state"]``. Also swallow an
    exception the app re-raises after answering 500, so no traceback reaches the server log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])
        scope.setdefault("state", {})["request_id"] = rid.decode()
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log.error(
                "request failed",
                extra={"error_type": type(exc).__name__, "request_id": rid.decode()},
            )
            if not started:
                await send_error(send_with_id, 500, "internal", "internal error")


class BodyLimitMiddleware:
    """Answer 413 for bodies over the limit, before anything parses or verifies them.

    The body is buffered (every route needs all of it: signature check, JSON) and replayed."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def _too_large(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject("body_size")
        await send_error(
            send,
            413,
            "payload_too_large",
            f"request body exceeds {self.max_bytes} bytes",
            [(b"connection", b"close")],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._too_large(send)
                    return
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class HeadAsGet:
    """``HEAD`` answered as the ``GET`` of the same path, without the body (RFC 9110 §9.3.2):
    same status and headers, ``Content-Length`` included. Only paths that have a ``GET``
    (what ``Allow`` lists HEAD for); any other ``HEAD`` goes on unchanged (405 with ``Allow``,
    or 404). Placed after the signature check, which verifies the method as sent: a signed
    ``HEAD`` is verified as ``HEAD``, then routed, authorised and answered as the ``GET``."""

    def __init__(self, app: ASGIApp, has_get: Callable[[str], bool]) -> None:
        self.app = app
        self.has_get = has_get

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD" or not self.has_get(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def send_head(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        # A copy: the server's own view of the request stays HEAD (it writes no body either).
        inner = dict(scope, method="GET")
        try:
            await self.app(inner, receive, send_head)
        finally:
            for name in ("route", "path_params", "endpoint"):  # for the metrics' route label
                if name in inner:
                    scope[name] = inner[name]
