"""The crypto operations' fast path: ``POST /v1/{op}/{key}`` goes straight to its endpoint.

FastAPI's route matching, dependency solving, request and exception layers cost ~130 us of a
~340 us request (docs/PERFORMANCE.md). The crypto routes need none of it: they take the raw body
and one path segment, and map their own errors. So they are matched here with one split, and
every other request (key management, health, the OpenAPI document, wrong methods) goes to
FastAPI. The routes stay declared in FastAPI, so the OpenAPI document and the metrics' route
labels are the same objects either way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request

from service.api.errors import send_cryptd_error
from service.asgi import ASGIApp, Receive, Scope, Send, route_path, send_json
from service.engine import OpName
from service.errors import CryptdError, Overloaded

Endpoint = Callable[[Request, OpName, str], Awaitable[bytes]]
"""endpoint(request, operation, key) -> JSON body of the 200 answer; raises CryptdError for
the error model."""


class CryptoDispatch:
    def __init__(
        self,
        app: ASGIApp,
        *,
        endpoint: Endpoint,
        routes: Mapping[OpName, Any],
        overloaded: Callable[[], bool] = lambda: False,
        on_overload: Callable[[], None] | None = None,
    ) -> None:
        """``routes`` maps each operation to its FastAPI route (set as ``scope["route"]``, which
        the metrics read for their label). While ``overloaded()`` is true (the event loop runs
        late: service/pool/lag.py) crypto requests are refused with 503 before any work;
        ``on_overload`` counts them."""
        self.app = app
        self.endpoint = endpoint
        self.overloaded = overloaded
        self.on_overload = on_overload
        self.routes: dict[str, tuple[OpName, Any]] = {op: (op, r) for op, r in routes.items()}
        if not self.routes:
            raise ValueError("no crypto routes to dispatch")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = self.match(scope)
        if target is None:
            await self.app(scope, receive, send)
            return
        (operation, route), key = target
        scope["route"] = route
        scope["path_params"] = {"key": key}
        if self.overloaded():
            if self.on_overload is not None:
                self.on_overload()
            await send_cryptd_error(send, Overloaded("event loop overloaded"))
            return
        try:
            body = await self.endpoint(Request(scope, receive), operation, key)
        except CryptdError as exc:
            await send_cryptd_error(send, exc)
            return
        await send_json(send, 200, body)

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
