"""ASGI middleware that authenticates every ``/v1/`` request, and the policy checks routes call.

Order of checks: signature (and body digest) -> replay -> rate limit -> media type (a body
must be ``application/json``: 415; after authentication, so an unauthenticated caller learns
nothing but 401). A nonce is stored only once the signature is valid, so unauthenticated
traffic cannot fill the replay store, and a request refused for its rate still spent its nonce
(a replay of it stays refused).

Mutual TLS (service/auth/certs.py): a client that lists certificate identities must sign over
a connection whose verified client certificate carries one of them, else 401. A request with
no signature fields at all, over a certificate that names a certificate-only client, is that
client's: policies and rate limits apply; there is no nonce to remember, and TLS itself makes
a captured request impossible to play again (docs/AUTH.md).

Nothing here logs a secret, a signature, or the Signature / Signature-Input values; failures
are logged with their reason only.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from service.asgi import ASGIApp, Message, Receive, Scope, Send, route_path, send_error
from service.auth.certs import peer_identities
from service.auth.clients import Client, ClientRegistry
from service.auth.ratelimit import RateLimiter
from service.auth.replay import ReplayStore, StoreRecovering, StoreUnavailable
from service.auth.signature import DEFAULT_MAX_SKEW, SIGNATURE_HEADERS, AuthError, verify_request
from service.errors import Forbidden, Overloaded, RateLimited, Unauthenticated, UnsupportedMediaType

logger = logging.getLogger("cryptd.auth")

PROTECTED_PREFIX = "/v1/"
STATE_KEY = "client"
JSON = "application/json"
WANTED_HEADERS = {name.encode("ascii"): name for name in SIGNATURE_HEADERS}


Refusal = AuthError | RateLimited | StoreUnavailable | UnsupportedMediaType
REFUSED = (AuthError, RateLimited, StoreUnavailable, UnsupportedMediaType)
"""What :meth:`SignatureAuthMiddleware.authenticate` raises for :meth:`~.refuse` to answer."""


class SignatureAuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        registry_provider: Callable[[], ClientRegistry],
        replay: ReplayStore,
        rate_limiter: RateLimiter | None,
        max_age: int,
        max_skew: int = DEFAULT_MAX_SKEW,
        fail_open: bool,
        on_failure: Callable[[str], None] | None = None,
        on_rejection: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``on_failure(reason)`` is called for every 401 (reasons: see
        :data:`service.auth.signature.Reason`); ``on_rejection(cause)`` for every request
        refused after authentication: ``"rate_limited"`` (429), ``"replay_unavailable"``
        (503), ``"replay_recovering"`` (503: created before the replay store's epoch) or
        ``"media_type"`` (415). Both are for metrics and must not raise. ``max_skew`` must be
        the one the replay store was given."""
        self.app = app
        self.registry_provider = registry_provider
        self.replay = replay
        self.rate_limiter = rate_limiter
        self.max_age = max_age
        self.max_skew = max_skew
        self.fail_open = fail_open
        self.on_failure = on_failure
        self.on_rejection = on_rejection
        self.clock = clock
        self._store_down = False
        self._recovering_logged = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not _protected(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # the API has none: never let one through unsigned
            await send({"type": "websocket.close", "code": 1008})
            return
        body = await _read_body(receive)
        if body is None:  # the client went away
            return
        try:
            await self.authenticate(scope, signature_headers(scope["headers"]), body)
        except REFUSED as exc:
            await self.refuse(exc, scope, send)
            return
        await self.app(scope, _replay_body(body, receive), send)

    async def authenticate(self, scope: Scope, headers: dict[str, str], body: bytes) -> Client:
        """The authenticated client of a request whose whole body is ``body``; it is also put
        in ``scope["state"]``. ``headers``: :func:`signature_headers` of the request (or the
        same mapping built in one pass with other headers). Raises :class:`AuthError` (401),
        :class:`RateLimited` (429), :class:`StoreUnavailable` (503) or, once the client is
        known, :class:`UnsupportedMediaType` (415: a body not sent as JSON): hand it to
        :meth:`refuse`."""
        registry = self.registry_provider()
        if "signature" not in headers and "signature-input" not in headers:
            return await self._by_certificate(scope, registry, headers, body)
        raw_path: bytes | None = scope.get("raw_path")
        try:
            path = scope["path"] if raw_path is None else raw_path.decode("ascii")
            query = scope.get("query_string", b"").decode("ascii")
        except UnicodeDecodeError:
            raise AuthError("malformed") from None
        now = self.clock()
        signed = verify_request(
            method=scope["method"],
            path=path,
            query=query,
            headers=headers,
            body=body,
            secret_for=registry.secret_for,
            now=now,
            max_age=self.max_age,
            max_skew=self.max_skew,
        )
        client = registry.get(signed.keyid)
        if client is None:  # removed between the two lookups by a reload: same answer
            raise AuthError("unknown_client")
        if client.certificates and client.certificates.isdisjoint(peer_identities(scope)):
            raise AuthError("certificate_mismatch")

        # Remember the nonce until the signature could no longer pass the created check.
        ttl = max(1, math.ceil(signed.created + self.max_age - now) + 1)
        if not await self._remember(signed.keyid, signed.nonce, signed.created, ttl):
            raise AuthError("replayed")
        _set_client(scope, client)  # authenticated: a 429 or 415 below names it in the logs
        if self.rate_limiter is not None:
            await self.rate_limiter.acquire(client.client_id)
        if body and not is_json(headers.get("content-type")):
            raise UnsupportedMediaType()
        return client

    async def _by_certificate(
        self, scope: Scope, registry: ClientRegistry, headers: dict[str, str], body: bytes
    ) -> Client:
        """A request without signature fields: the certificate-only client its connection's
        verified client certificate names, if any."""
        identities = peer_identities(scope)
        if not identities:
            raise AuthError("missing_signature")
        client = registry.by_certificate(identities)
        if client is None:
            raise AuthError("unknown_certificate")
        _set_client(scope, client)  # authenticated: a 429 or 415 below names it in the logs
        if self.rate_limiter is not None:
            await self.rate_limiter.acquire(client.client_id)
        if body and not is_json(headers.get("content-type")):
            raise UnsupportedMediaType()
        return client

    async def refuse(self, exc: Refusal, scope: Scope, send: Send) -> None:
        """Answer a request :meth:`authenticate` refused (401, 429, 503 or 415), log and count
        it."""
        if isinstance(exc, AuthError):
            logger.info(
                "request refused: unauthenticated (reason=%s peer=%s)", exc.reason, _peer(scope)
            )
            if self.on_failure is not None:
                self.on_failure(exc.reason)
            await send_error(send, 401, Unauthenticated.code, Unauthenticated.default_message)
        elif isinstance(exc, UnsupportedMediaType):
            self._rejected("media_type", scope)
            await send_error(send, 415, exc.code, exc.message)
        elif isinstance(exc, RateLimited):
            self._rejected("rate_limited", scope)
            retry_after = str(max(1, math.ceil(exc.retry_after))).encode()
            await send_error(send, 429, exc.code, exc.message, [(b"retry-after", retry_after)])
        elif isinstance(exc, StoreRecovering):
            # Perhaps the replay of a request accepted before the store started; an honest
            # client signs again (a new created time) after Retry-After and gets through.
            self._rejected("replay_recovering", scope)
            await send_error(
                send,
                503,
                Overloaded.code,
                "replay store restarted: sign the request again",
                [(b"retry-after", str(exc.retry_after).encode())],
            )
        else:
            self._rejected("replay_unavailable", scope)
            await send_error(
                send, 503, Overloaded.code, "replay store unavailable", [(b"retry-after", b"1")]
            )

    async def _remember(self, keyid: str, nonce: str, created: int, ttl: int) -> bool:
        try:
            first = await self.replay.remember(keyid, nonce, created, ttl)
        except StoreRecovering:  # never fail-open: the window is short and exactly the risk
            if not self._recovering_logged:
                self._recovering_logged = True
                logger.warning(
                    "replay store restarted: refusing requests signed before its start "
                    "(503, Retry-After) so that none accepted earlier is accepted again"
                )
            raise
        except StoreUnavailable as exc:
            if not self._store_down:
                self._store_down = True
                logger.error(
                    "replay store unavailable (%s); %s",
                    exc,
                    "accepting requests WITHOUT replay protection (fail-open)"
                    if self.fail_open
                    else "refusing signed requests with 503",
                )
            if self.fail_open:
                return True
            raise
        if self._store_down:
            self._store_down = False
            logger.warning("replay store reachable again")
        self._recovering_logged = False  # the next restart is logged again
        return first

    def _rejected(self, cause: str, scope: Scope) -> None:
        logger.info("request refused: %s (peer=%s)", cause, _peer(scope))
        if self.on_rejection is not None:
            self.on_rejection(cause)


def _set_client(scope: Scope, client: Client) -> None:
    state = scope.get("state")
    if state is None:
        scope["state"] = {STATE_KEY: client}
    else:
        state[STATE_KEY] = client


def is_json(content_type: str | None) -> bool:
    """``application/json``, case-insensitive, with parameters allowed (a ``charset`` other
    than UTF-8 is not: JSON is UTF-8, RFC 8259)."""
    if content_type is None:
        return False
    if content_type == JSON:
        return True
    media, _, parameters = content_type.partition(";")
    if media.strip().lower() != JSON:
        return False
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True


def signature_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The fields the verifier reads, by lower-case name; repeated field lines combined with
    ", " (RFC 9110 section 5.3)."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in raw:
        name = WANTED_HEADERS.get(raw_name.lower())
        if name is not None:
            add_field(headers, name, raw_value)
    return headers


def add_field(headers: dict[str, str], name: str, raw_value: bytes) -> None:
    """Add one field line to ``headers`` as :func:`signature_headers` does."""
    value = raw_value.decode("latin-1").strip(" \t")
    headers[name] = f"{headers[name]}, {value}" if name in headers else value


def _protected(scope: Scope) -> bool:
    # Mounted under a prefix: judge the app's own path.
    return route_path(scope).startswith(PROTECTED_PREFIX)


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "-"


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body (an outer middleware caps its size), or None on disconnect."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the buffered body once, then defers to the server."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# --------------------------------------------------------------------------------------------
# Policy checks for the routes


def client_from_scope(scope: Scope) -> Client:
    """The authenticated client of this request (``request.state.client``)."""
    client = scope.get("state", {}).get(STATE_KEY)
    if not isinstance(client, Client):
        # The middleware did not run for this route: refuse rather than run unauthenticated.
        raise Unauthenticated()
    return client


def authorize(client: Client, key: str, operation: str) -> None:
    """Raise :class:`~service.errors.Forbidden` unless ``client`` may ``operation`` on ``key``."""
    if not client.allows(key, operation):
        raise Forbidden()


def authorize_keyless(client: Client, operation: str) -> None:
    """Raise :class:`~service.errors.Forbidden` unless ``client`` may ``operation``, one that
    names no key (``random``)."""
    if not client.allows_keyless(operation):
        raise Forbidden()


def require_admin(client: Client) -> None:
    """Raise :class:`~service.errors.Forbidden` unless ``client`` may manage keys."""
    if not client.admin:
        raise Forbidden()
