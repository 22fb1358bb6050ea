"""Who sent a request, and may it be let in: signature, replay and rate limit, without HTTP.

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

The request is read from its ASGI scope (a plain mapping), its headers and its whole body;
the request pipeline (service/api/pipeline.py) calls :meth:`Authenticator.authenticate` and
sends the :meth:`~Authenticator.refusal` it gets back. Nothing here logs a secret, a
signature, or the Signature / Signature-Input values; failures are logged with their reason
only.

While the replay store cannot be reached, the authenticator asks it again every
:data:`REACQUIRE_INTERVAL` seconds until it answers (:meth:`Authenticator.reacquire`): a new
Redis primary's refusal window (its epoch) starts when cryptd first reaches it, and with every
host out of the balancer (their readiness fails during the outage) nothing else would reach it
before the next health check, which Kubernetes may send only seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from service.asgi import Scope
from service.auth.certs import peer_identities
from service.auth.clients import Client, ClientRegistry
from service.auth.policy import set_client
from service.auth.ratelimit import RateLimiter
from service.auth.replay import ReplayStore, StoreRecovering, StoreUnavailable, TooOld
from service.auth.signature import (
    DEFAULT_MAX_SKEW,
    SIGNATURE_HEADERS,
    AuthError,
    SignatureInput,
    verify_request,
)
from service.errors import Overloaded, RateLimited, Unauthenticated, UnsupportedMediaType

logger = logging.getLogger("cryptd.auth")

JSON = "application/json"
# While the replay store is unreachable, it is asked this often whether it answers again.
REACQUIRE_INTERVAL = 0.1
WANTED_HEADERS = {name.encode("ascii"): name for name in SIGNATURE_HEADERS}

Refusal = AuthError | RateLimited | StoreUnavailable | UnsupportedMediaType
REFUSED = (AuthError, RateLimited, StoreUnavailable, UnsupportedMediaType)
"""What :meth:`Authenticator.authenticate` raises for :meth:`~Authenticator.refusal` to answer."""


class Answer(NamedTuple):
    """An error answer: status, the error model's code and message, extra headers."""

    status: int
    code: str
    message: str
    headers: list[tuple[bytes, bytes]]


class Authenticator:
    def __init__(
        self,
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
        self._reacquiring: asyncio.Task[None] | None = None

    async def authenticate(self, scope: Scope, headers: dict[str, str], body: bytes) -> Client:
        """The authenticated client of a request whose whole body is ``body``; it is also put
        in ``scope["state"]``. ``headers``: :func:`signature_headers` of the request (or the
        same mapping built in one pass with other headers). Raises :class:`AuthError` (401),
        :class:`RateLimited` (429), :class:`StoreUnavailable` (503) or, once the client is
        known, :class:`UnsupportedMediaType` (415: a body not sent as JSON): hand it to
        :meth:`refusal`."""
        registry = self.registry_provider()
        if "signature" not in headers and "signature-input" not in headers:
            client = self._by_certificate(scope, registry)
        else:
            client, signed, now = self._by_signature(scope, registry, headers, body)
            # Remember the nonce until the signature could no longer pass the created check.
            # (Awaited here, not in a helper coroutine: the store's batch suspends every
            # request, and each coroutine between costs on the way out and back.)
            ttl = max(1, math.ceil(signed.created + self.max_age - now) + 1)
            try:
                first = await self.replay.remember(signed.keyid, signed.nonce, signed.created, ttl)
            except TooOld:  # by the shared store's clock: this replica's clock is behind
                raise AuthError("stale") from None
            except StoreRecovering:  # never fail-open: the window is short and exactly the risk
                self._recovering()
                raise
            except StoreUnavailable as exc:
                if not self._unavailable(exc):
                    raise
                first = True  # fail-open
            else:
                if self._store_down:
                    self._store_down = False
                    logger.warning("replay store reachable again")
                self._recovering_logged = False  # the next restart is logged again
            if not first:
                raise AuthError("replayed")
        set_client(scope, client)  # authenticated: a 429 or 415 below names it in the logs
        if self.rate_limiter is not None:
            await self.rate_limiter.acquire(client.client_id)
        if body and not is_json(headers.get("content-type")):
            raise UnsupportedMediaType()
        return client

    def _by_signature(
        self, scope: Scope, registry: ClientRegistry, headers: dict[str, str], body: bytes
    ) -> tuple[Client, SignatureInput, float]:
        """The client whose valid signature the request carries, the signature, and the time
        it was checked at; its nonce is not yet remembered."""
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
        return client, signed, now

    def _by_certificate(self, scope: Scope, registry: ClientRegistry) -> Client:
        """A request without signature fields: the certificate-only client its connection's
        verified client certificate names, if any."""
        identities = peer_identities(scope)
        if not identities:
            raise AuthError("missing_signature")
        client = registry.by_certificate(identities)
        if client is None:
            raise AuthError("unknown_certificate")
        return client

    def refusal(self, exc: Refusal, scope: Scope) -> Answer:
        """The answer to a request :meth:`authenticate` refused (401, 429, 503 or 415), once
        logged and counted."""
        if isinstance(exc, AuthError):
            logger.info(
                "request refused: unauthenticated (reason=%s peer=%s)", exc.reason, _peer(scope)
            )
            if self.on_failure is not None:
                self.on_failure(exc.reason)
            return Answer(401, Unauthenticated.code, Unauthenticated.default_message, [])
        if isinstance(exc, UnsupportedMediaType):
            self._rejected("media_type", scope)
            return Answer(415, exc.code, exc.message, [])
        if isinstance(exc, RateLimited):
            self._rejected("rate_limited", scope)
            retry_after = str(max(1, math.ceil(exc.retry_after))).encode()
            return Answer(429, exc.code, exc.message, [(b"retry-after", retry_after)])
        if isinstance(exc, StoreRecovering):
            # Perhaps the replay of a request accepted before the store started; an honest
            # client signs again (a new created time) after Retry-After and gets through.
            self._rejected("replay_recovering", scope)
            return Answer(
                503,
                Overloaded.code,
                "replay store restarted: sign the request again",
                [(b"retry-after", str(exc.retry_after).encode())],
            )
        self._rejected("replay_unavailable", scope)
        return Answer(503, Overloaded.code, "replay store unavailable", [(b"retry-after", b"1")])

    def _recovering(self) -> None:
        if not self._recovering_logged:
            self._recovering_logged = True
            logger.warning(
                "replay store restarted: refusing requests signed before its start "
                "(503, Retry-After) so that none accepted earlier is accepted again"
            )

    def _unavailable(self, exc: StoreUnavailable) -> bool:
        """Logged once per outage; True when the request goes on anyway (fail-open)."""
        if self._reacquiring is None or self._reacquiring.done():
            self._reacquiring = asyncio.get_running_loop().create_task(self.reacquire())
        if not self._store_down:
            self._store_down = True
            logger.error(
                "replay store unavailable (%s); %s",
                exc,
                "accepting requests WITHOUT replay protection (fail-open)"
                if self.fail_open
                else "refusing signed requests with 503",
            )
        return self.fail_open

    async def reacquire(self, interval: float = REACQUIRE_INTERVAL) -> None:
        """Ask the replay store every ``interval`` seconds until it answers: accepting requests
        signed now, or refusing them for its epoch (a new primary reached, its window begun).
        Started by the first request the store could not answer; a store check costs it one
        connection attempt (through the Sentinels: one question to them)."""
        while True:
            await asyncio.sleep(interval)
            try:
                health = await self.replay.health()
            except Exception as exc:  # health() reports failures itself; the last guard
                logger.debug("replay store check failed: %s", type(exc).__name__)
                continue
            if health.ok or health.retry_after is not None:
                logger.warning(
                    "replay store answers again (%s)",
                    "accepting requests"
                    if health.ok
                    else f"refusing requests signed before its epoch for {health.retry_after} s",
                )
                return

    async def aclose(self) -> None:
        """Stop asking a store that is down (shutdown)."""
        if self._reacquiring is not None:
            self._reacquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reacquiring
            self._reacquiring = None

    def _rejected(self, cause: str, scope: Scope) -> None:
        logger.info("request refused: %s (peer=%s)", cause, _peer(scope))
        if self.on_rejection is not None:
            self.on_rejection(cause)


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


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "-"
