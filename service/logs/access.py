"""The access log: one line per HTTP request, from the fields of its ASGI scope."""

from __future__ import annotations

import time
from typing import Any

import orjson

from service.asgi import Scope
from service.logs.fields import plain, timestamp
from service.logs.writer import LineWriter


class AccessLog:
    """One line per HTTP request, fed by the metrics timing middleware (which measures once for
    both). Fields come from the request scope; the API puts the request-scoped ones in
    ``scope["state"]``: request_id, client (``.id``), key, operation, key_version."""

    def __init__(self, writer: LineWriter) -> None:
        self._writer = writer

    def __call__(self, scope: Scope, route: str, status: int, seconds: float) -> None:
        state = scope.get("state") or {}
        remote = scope.get("client")
        fields = (
            time.time(),
            state.get("request_id"),
            _client_id(state.get("client")),
            scope.get("method"),
            route,
            status,
            seconds,
            state.get("key"),
            state.get("operation"),
            state.get("key_version"),
            remote[0] if remote else None,
        )
        self._writer.write((_format_access, fields))


def _client_id(client: object) -> object:
    """The authenticated client's id: ``.id`` (the API's Caller) or ``.client_id``."""
    found = getattr(client, "id", None)
    return found if found is not None else getattr(client, "client_id", None)


def _format_access(fields: tuple[Any, ...]) -> bytes:
    when, request_id, client, method, route, status, seconds, key, operation, version, remote = (
        fields
    )
    line = {
        "ts": timestamp(when),
        "level": "info",
        "logger": "cryptd.access",
        "msg": "request",
        "request_id": plain(request_id),
        "client": plain(client),
        "method": plain(method),
        "route": route,
        "status": status,
        "latency_ms": round(seconds * 1000.0, 3),
        "key": plain(key),
        "operation": plain(operation),
        "key_version": plain(version),
        "remote": plain(remote),
    }
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
