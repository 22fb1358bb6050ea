"""Each request timed once, for the metrics and the access log, labelled by its route template.

Routes are labelled by their template (``/v1/encrypt/{key}``), never by the raw path: key names
and junk paths would make the label set unbounded. The request pipeline (pipeline.py) times
cryptd's own requests; :func:`timed` wraps any other ASGI app the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any, Protocol

from starlette.routing import Match

from service.asgi import ASGIApp, Message, Receive, Scope, Send
from service.metrics import Metrics

log = logging.getLogger("cryptd.metrics")

UNMATCHED = "unmatched"
_MAX_DEPTH = 4

RecordRequest = Callable[[str, str, int, float], None]
"""record(route, method, status, seconds)"""


class AccessLogSink(Protocol):
    def __call__(self, scope: Scope, route: str, status: int, seconds: float) -> None:
        """Called once per HTTP request after the response was sent."""


class RequestTimer:
    """Feeds one answered request to the metrics and the access log; never raises."""

    def __init__(self, *, record: RecordRequest | None, access_log: AccessLogSink | None) -> None:
        self._record = record
        self._access_log = access_log

    @classmethod
    def of(cls, metrics: Metrics, access_log: AccessLogSink | None = None) -> RequestTimer | None:
        """The timer of ``metrics`` (when enabled) and ``access_log``; None with neither."""
        record = metrics.observe_request if metrics.enabled else None
        if record is None and access_log is None:
            return None
        return cls(record=record, access_log=access_log)

    def finish_unrouted(self, scope: Scope, status: int, seconds: float) -> None:
        """:meth:`finish` under the template of the route that handled (or would have handled)
        the request."""
        try:
            route = route_template(scope)
        except Exception as exc:  # observability must never fail a request
            log.warning("request observation failed: %s", type(exc).__name__)
            return
        self.finish(scope, route, status, seconds)

    def finish(self, scope: Scope, route: str, status: int, seconds: float) -> None:
        """Record one answered request."""
        try:
            if self._record is not None:
                self._record(route, scope["method"], status, seconds)
            if self._access_log is not None:
                self._access_log(scope, route, status, seconds)
        except Exception as exc:  # observability must never fail a request
            log.warning("request observation failed: %s", type(exc).__name__)


class TimingMiddleware:
    def __init__(self, app: ASGIApp, timer: RequestTimer) -> None:
        self.app = app
        self.timer = timer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers when the app fails before responding

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = perf_counter()
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.timer.finish_unrouted(scope, status, perf_counter() - started)


def timed(metrics: Metrics, app: ASGIApp, *, access_log: AccessLogSink | None = None) -> ASGIApp:
    """Wrap ``app`` so every HTTP request is timed once and fed to the metrics and, when
    given, the access log. With neither, ``app`` comes back unchanged (no cost at all)."""
    timer = RequestTimer.of(metrics, access_log)
    return app if timer is None else TimingMiddleware(app, timer)


def route_template(scope: Scope) -> str:
    """The template of the route that handled (or would have handled) the request.

    The router sets ``scope["route"]``. A request answered before routing (401 from the
    signature check, 413 from the body limit) has none: it is matched against the app's routes
    here, so a refused ``POST /v1/decrypt/k`` still counts under ``/v1/decrypt/{key}``.
    """
    route = scope.get("route")
    if route is not None:
        path = getattr(route, "path", None)
        if isinstance(path, str):
            return path
    router = getattr(scope.get("app"), "router", None)
    return _match(getattr(router, "routes", ()), scope, 0) or UNMATCHED


def _match(routes: Iterable[Any], scope: Scope, depth: int) -> str | None:
    """Like the router: the first full match, else the first partial one (wrong method).
    Routers nested in routes (FastAPI's included routers, mounts) are searched too."""
    partial: str | None = None
    for candidate in routes:
        try:
            match, _ = candidate.matches(scope)
        except Exception:  # noqa: S112 - a route that cannot judge this scope is not a match
            continue
        if match is Match.NONE:
            continue
        path = getattr(candidate, "path", None)
        if not (isinstance(path, str) and path):
            nested = getattr(getattr(candidate, "original_router", candidate), "routes", None)
            path = _match(nested, scope, depth + 1) if nested and depth < _MAX_DEPTH else None
        if path is None:
            continue
        if match is Match.FULL:
            return path
        partial = partial or path
    return partial
