"""Small ASGI helpers shared by the request pipeline, the middlewares and the API: one error body
shape everywhere, the body read whole (and handed on again)."""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}\Z")


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The client's ``X-Request-ID`` if it is sane (names lower-case, as servers give them),
    else a fresh one."""
    for name, value in headers:
        if name == b"x-request-id":
            return request_id_of(value)
    return request_id_of(b"")


def request_id_of(client_value: bytes) -> bytes:
    """``client_value`` (the first ``X-Request-ID``; b"" when none) if it is sane, else a fresh
    id."""
    if client_value and _CLIENT_REQUEST_ID.match(client_value):  # most requests send none
        return client_value
    return f"{_id_prefix}{next(_id_counter):016x}".encode()


# Fresh request ids: 32 hex digits, a random per-process prefix and a counter. Ids must be
# unique, not unpredictable (they trace a request through the logs), and this costs no system
# call per request; a forked process draws a prefix of its own.
_id_prefix = secrets.token_hex(8)
_id_counter = itertools.count()


def _new_id_prefix() -> None:
    global _id_prefix, _id_counter
    _id_prefix = secrets.token_hex(8)
    _id_counter = itertools.count()


os.register_at_fork(after_in_child=_new_id_prefix)


def route_path(scope: Scope) -> str:
    """The path the app routes on: ``scope["path"]`` without the ``root_path`` it is mounted at."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send a complete JSON response (used by middleware that answers before the app)."""
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send,
    status: int,
    code: str,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send_json(send, status, error_body(code, message), headers)


class BodyTooLarge(Exception):
    """The request body is over the limit :func:`read_body` was given."""


async def read_body(receive: Receive, limit: float = float("inf")) -> bytes | None:
    """The whole request body, or None when the client went away. Raises
    :class:`BodyTooLarge` as soon as more than ``limit`` bytes have arrived."""
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
        raise BodyTooLarge()
    return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the buffered body once, then defers to the server."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
