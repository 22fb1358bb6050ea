"""The HTTP edge of the error model: one status per code, one body shape for every error,
FastAPI's and Starlette's own errors included."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.api.spec import allowed_methods
from service.asgi import Send, error_body, send_error
from service.errors import CryptdError, InvalidRequest, Overloaded, RateLimited, SchemaError
from service.keys.keyring import check_key_name

log = logging.getLogger("cryptd.api")

STATUS: dict[str, int] = {
    "invalid_request": 400,
    "decryption_failed": 400,
    "unauthenticated": 401,
    "forbidden": 403,
    "key_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "conflict": 409,
    "key_disabled": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "headers_too_large": 431,
    "request_timeout": 408,
    "rate_limited": 429,
    "overloaded": 503,
    "keystore_unavailable": 503,
    "sealed": 503,
    "audit_unavailable": 503,
    "internal": 500,
}


def status_for(exc: CryptdError) -> int:
    return 422 if isinstance(exc, SchemaError) else STATUS.get(exc.code, 500)


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(
        error_body(code, message),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _retry_after(exc: CryptdError) -> str | None:
    """Seconds to wait, for the answers a retry can cure: 429 and every 503."""
    if isinstance(exc, Overloaded | RateLimited):
        return str(max(1, round(exc.retry_after)))
    if status_for(exc) == 503:
        return "1"
    return None


def cryptd_error_response(exc: CryptdError) -> Response:
    retry_after = _retry_after(exc)
    headers = None if retry_after is None else {"Retry-After": retry_after}
    return error_response(status_for(exc), exc.code, exc.message, headers)


async def send_cryptd_error(send: Send, exc: CryptdError) -> None:
    """:func:`cryptd_error_response`, sent straight to the server (pure ASGI callers)."""
    retry_after = _retry_after(exc)
    headers = None if retry_after is None else [(b"retry-after", retry_after.encode())]
    await send_error(send, status_for(exc), exc.code, exc.message, headers)


async def _on_cryptd_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, CryptdError)
    return cryptd_error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error.get("loc", ())) or "request"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return error_response(422, "invalid_request", "; ".join(parts) or "invalid request")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        bad_name = encoded_key_name_error(request.scope.get("raw_path"))
        if bad_name is not None:
            return cryptd_error_response(bad_name)
        return error_response(404, "not_found", "no such route")
    if exc.status_code == 405:
        allowed = _allowed_methods(request.url.path)
        headers = {"Allow": allowed} if allowed else exc.headers
        return error_response(
            405, "method_not_allowed", "method not allowed on this route", headers
        )
    code = "invalid_request" if 400 <= exc.status_code < 500 else "internal"
    message = "invalid request" if code == "invalid_request" else "internal error"
    return error_response(exc.status_code, code, message, exc.headers)


def encoded_key_name_error(raw_path: bytes | None) -> InvalidRequest | None:
    """Why a path that matched no route is a bad key name, if it is one: the key segment of a
    keyed route, percent-decoded, holds a '/' (``a%2Fb`` splits the decoded path, so no route
    matches) or is otherwise not a key name. Only called for a 404: no cost on a hit."""
    if not raw_path or b"%" not in raw_path:
        return None
    parts = raw_path.decode("latin-1").split("/")
    if len(parts) < 4 or parts[0] or parts[1] != "v1":
        return None
    if not allowed_methods("/".join(["", "v1", parts[2], "key", *parts[4:]])):
        return None  # not a route with a key name there
    try:
        check_key_name(unquote_to_bytes(parts[3]).decode("ascii"))
    except UnicodeDecodeError:
        return InvalidRequest("key name must match [A-Za-z0-9_.-]{1,128}")
    except InvalidRequest as exc:
        return exc
    return None


def _allowed_methods(path: str) -> str | None:
    """Every declared method on this path (Starlette's own header names only the methods of
    the first route that matched the path)."""
    methods = allowed_methods(path)
    return ", ".join(methods) if methods else None


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # Type only: the message or traceback could carry request data.
    log.error("unhandled error", extra={"error_type": type(exc).__name__})
    return error_response(500, "internal", "internal error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(CryptdError, _on_cryptd_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
