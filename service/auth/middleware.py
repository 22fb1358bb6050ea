"""The authenticator as a stand-alone ASGI middleware, for an ASGI app other than cryptd's own.

cryptd's application runs the authenticator inside its request pipeline
(service/api/pipeline.py), among the other checks and in their order. This wraps any ASGI app
with the authenticator alone (what the contract tests and the authentication benchmarks
serve): every ``/v1/`` request is read whole, authenticated, and either refused or handed on
with its body replayed. No web framework is involved.
"""

from __future__ import annotations

from typing import Any

from service.asgi import ASGIApp, Receive, Scope, Send, read_body, replay_body, send_error
from service.auth.authenticator import REFUSED, Authenticator, signature_headers
from service.auth.clients import Client
from service.auth.policy import is_protected


class SignatureAuthMiddleware:
    def __init__(self, app: ASGIApp, **options: Any) -> None:
        """``options``: those of :class:`~service.auth.authenticator.Authenticator`."""
        self.app = app
        self.authenticator = Authenticator(**options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not is_protected(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # the API has none: never let one through unsigned
            await send({"type": "websocket.close", "code": 1008})
            return
        body = await read_body(receive)
        if body is None:  # the client went away
            return
        try:
            await self.authenticator.authenticate(scope, signature_headers(scope["headers"]), body)
        except REFUSED as exc:
            await send_error(send, *self.authenticator.refusal(exc, scope))
            return
        await self.app(scope, replay_body(body, receive), send)

    async def authenticate(self, scope: Scope, headers: dict[str, str], body: bytes) -> Client:
        """The authenticator's :meth:`~service.auth.authenticator.Authenticator.authenticate`."""
        return await self.authenticator.authenticate(scope, headers, body)
