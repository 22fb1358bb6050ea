"""The request pipeline: every HTTP request passes the same ordered checks, in one coroutine.

1. request id (the client's ``X-Request-ID`` when sane, else a fresh one), echoed on the answer;
2. body limit: 413 for a declared or actual body over ``max_body_bytes`` (the body is read
   whole: the signature covers it);
3. signature, replay and rate limit (:class:`~service.auth.authenticator.Authenticator`), for
   the API's paths (``/v1/``): 401 / 429 / 503 / 415;
4. the answer:

   - a crypto operation (``POST /v1/{op}/{key}``): event-loop lag first (503 ``overloaded``
     while the loop runs late, service/pool/lag.py), then ``endpoint(scope, body, op, key)``
     (policy, body, crypto, audit), its JSON written here;
   - any other request (key management, health, metrics, the OpenAPI document, wrong
     methods): ``app``, FastAPI's stack, with the body handed on; its routes apply the client
     policies (service/auth/policy.py);

5. the audit record of every ``/v1/`` request, authenticated or refused, made durable before
   the answer's first byte (service/api/auditing.py; 503 ``audit_unavailable`` instead of an
   answer whose record could not be written, when the audit fails closed);
6. timing for the metrics and the access log, once, whatever the outcome; an unexpected error is
   logged by type and answered 500.

The crypto operations skip FastAPI altogether: matched with one split, their headers read in
one pass, no Starlette ``Request``. Their routes stay declared in FastAPI, so the OpenAPI
document, the 405 answers and the metrics' route labels are the same objects either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter
from typing import Any, Final

from service.api.auditing import AuditedSend
from service.api.errors import send_cryptd_error
from service.api.timing import RequestTimer
from service.asgi import (
    ASGIApp,
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    read_body,
    replay_body,
    request_id_of,
    route_path,
    send_error,
)
from service.auth.authenticator import REFUSED, WANTED_HEADERS, Authenticator
from service.auth.policy import is_protected
from service.errors import CryptdError, Overloaded
from service.errors import Sealed as SealedError
from service.logs.audit import Audit
from service.operations import OpName
from service.pool import InFlight

log = logging.getLogger("cryptd.api")

Endpoint = Callable[[Scope, bytes, OpName, str], Awaitable[bytes]]
"""endpoint(scope, body, operation, key) -> JSON body of the 200 answer; raises CryptdError
for the error model. ``scope["state"]["client"]`` is the authenticated client."""

_CONTENT_TYPE = (b"content-type", b"application/json")

# The one /v1/ route answered unsigned: an operator asks it before any client can sign.
_UNSIGNED_GET = "/v1/sys/seal-status"
# What a sealed server answers under /v1/ (every other route: 503 sealed).
_WHILE_SEALED = frozenset({_UNSIGNED_GET, "/v1/sys/unseal"})


# What the header pass does with a field name: a signature field (its lower-case name, matched
# whatever the case, as signature_headers does), the declared length, the request id (both
# matched exactly), or nothing. Names are looked up once each: one dict lookup a header line
# instead of a case fold and two. Names seen are remembered, a bounded number.
# The two roles that are not a field's name are spelled so that no field name equals them.
_OTHER: Final = ""
_LENGTH: Final = ":length"
_REQUEST_ID: Final = ":request-id"
_HEADER_ROLES: dict[bytes, str] = {
    **WANTED_HEADERS,
    b"content-length": _LENGTH,
    b"x-request-id": _REQUEST_ID,
    **dict.fromkeys((b"host", b"user-agent", b"accept", b"connection"), _OTHER),
}
_HEADER_ROLES_MAX: Final = 256


def _role_of(name: bytes) -> str:
    role = WANTED_HEADERS.get(name.lower())
    if role is None:
        role = _OTHER
    if len(_HEADER_ROLES) < _HEADER_ROLES_MAX:
        _HEADER_ROLES[name] = role
    return role


def _unsigned(scope: Scope) -> bool:
    return scope["method"] in ("GET", "HEAD") and route_path(scope) == _UNSIGNED_GET


class RequestPipeline:
    def __init__(
        self,
        app: ASGIApp,
        *,
        endpoint: Endpoint,
        routes: Mapping[OpName, Any],
        authenticator: Authenticator | None = None,
        max_body_bytes: int = 1024 * 1024,
        on_body_rejected: Callable[[str], None] | None = None,
        timer: RequestTimer | None = None,
        overloaded: Callable[[], bool] = lambda: False,
        on_overload: Callable[[], None] | None = None,
        cheap: InFlight | None = None,
        costly: Callable[[str], bool] = lambda key: False,
        sealed: bool = False,
        audit: Audit | None = None,
    ) -> None:
        """``app`` answers every request but the crypto operations. ``routes`` maps each
        operation to its FastAPI route (set as ``scope["route"]``; its path is the metrics'
        label). ``authenticator`` checks the signature (None: none is checked, and every
        crypto request is refused 401 by the endpoint's policy check); ``timer`` is the metrics
        and access-log recorder (None: neither is on). While ``overloaded()`` is true crypto
        requests are refused with 503 before any work; ``on_overload`` counts them,
        ``on_body_rejected("body_size")`` counts 413s. ``cheap`` counts the crypto requests in
        progress whose key is not ``costly(key)``: the ones costly work on the loop yields to
        (service/pool/sliced.py). ``sealed``: the pipeline of a server without its master key
        (service/api/sealed.py): every /v1/ route but the seal's answers 503 ``sealed``.
        ``audit``: where every ``/v1/`` request's record goes."""
        self.app = app
        self.sealed = sealed
        self.audit = audit if audit is not None and audit.enabled else None
        self.endpoint = endpoint
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        self.on_body_rejected = on_body_rejected
        self.timer = timer
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
        if scope["type"] != "http":
            await self._not_http(scope, receive, send)
            return
        started = perf_counter()
        target = self.match(scope)
        route: Any = None
        if target is not None:
            (operation, route), key = target
            scope["route"] = route
            scope["path_params"] = {"key": key}
        # One pass over the headers for every check: request id, declared length, signature.
        request_id = b""
        declared = -1
        headers: dict[str, str] = {}
        roles = _HEADER_ROLES
        for name, value in scope["headers"]:
            role = roles.get(name)
            if role is None:
                role = _role_of(name)
            if role == _OTHER:
                continue
            if role == _LENGTH:
                if declared < 0:
                    try:
                        declared = int(value)
                    except ValueError:
                        declared = 0
            elif role == _REQUEST_ID:
                if not request_id:
                    request_id = value
            else:  # a signature field: add_field, inlined
                text = value.decode("latin-1").strip(" \t")
                headers[role] = f"{headers[role]}, {text}" if role in headers else text
        request_id = request_id_of(request_id)
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state["request_id"] = request_id.decode()
        if target is not None:
            state["crypto_operation"] = operation  # names a refused one's audit record
        status = 500  # what the server answers when nothing was sent
        response_started = False
        # Signed and audited: every /v1/ route but the seal's unsigned status. A crypto request
        # (a POST under /v1/) always is.
        protected = target is not None or (is_protected(scope) and not _unsigned(scope))
        answer_to: Send = send
        audited: AuditedSend | None = None
        if self.audit is not None and protected:
            # The record first, then the answer: every answer below passes the audit.
            answer_to = audited = AuditedSend(self.audit, scope, send, request_id)

        async def send_with_id(message: Any) -> None:
            # Every answer but the crypto 200 (written below) passes here and gets the id.
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await answer_to(message)

        cheap = self.cheap
        if cheap is not None and target is not None and not self.costly(key):
            cheap.start()
        else:
            cheap = None
        try:
            if self.sealed and is_protected(scope) and route_path(scope) not in _WHILE_SEALED:
                await send_cryptd_error(send_with_id, SealedError())
                return
            if declared > self.max_body_bytes:
                await self._too_large(send_with_id)
                return
            try:
                body = await read_body(receive, self.max_body_bytes)
            except BodyTooLarge:
                await self._too_large(send_with_id)
                return
            if body is None:  # the client went away
                return
            authenticator = self.authenticator
            if authenticator is not None and (target is not None or protected):
                try:
                    await authenticator.authenticate(scope, headers, body)
                except REFUSED as exc:
                    await send_error(send_with_id, *authenticator.refusal(exc, scope))
                    return
            if target is None:
                await self.app(scope, replay_body(body, receive), send_with_id)
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
            start: dict[str, Any] = {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    _CONTENT_TYPE,
                    (b"content-length", str(len(answer)).encode()),
                    (b"x-request-id", request_id),
                ],
            }
            status = 200
            response_started = True
            # Audited: the record is written first; if it could not be and the audit fails
            # closed, refuse() has answered 503 instead.
            if audited is not None and not await audited.written(200) and await audited.refuse():
                return
            await send(start)
            await send({"type": "http.response.body", "body": answer})
        except Exception as exc:
            # Also what the app re-raises after answering 500: no traceback in the server log.
            log.error(
                "request failed",
                extra={"error_type": type(exc).__name__, "request_id": state["request_id"]},
            )
            if not response_started:
                await send_error(send_with_id, 500, "internal", "internal error")
            elif audited is not None:
                await audited.abandon()
        finally:
            if audited is not None:
                audited.close()
                if audited.replaced:
                    status = 503
            ended = perf_counter()
            if cheap is not None:
                cheap.end(ended)
            timer = self.timer
            if timer is not None:
                if route is not None:
                    timer.finish(scope, route.path, status, ended - started)
                else:
                    timer.finish_unrouted(scope, status, ended - started)

    async def _not_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Lifespan goes to the app; so does a websocket, unless it needs authenticating: the
        API has none, so one is never let through unsigned."""
        if scope["type"] == "websocket" and self.authenticator is not None and is_protected(scope):
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)

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
