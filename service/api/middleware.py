"""``HEAD`` answered as ``GET``: the one ASGI layer between the request pipeline
(pipeline.py) and FastAPI."""

from __future__ import annotations

from collections.abc import Callable

from service.asgi import ASGIApp, Message, Receive, Scope, Send


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
