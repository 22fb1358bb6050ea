"""What the blocking and the async client share, written once (httpx's ``BaseClient``
pattern): the settings, building and signing each request, reading each response or error,
and deciding the retries. None of it does I/O: a call runs as :class:`Steps`, a sequence of
actions (a request to send, a delay to sleep) that a transport carries out and answers."""

from __future__ import annotations

import base64
import binascii
import email.utils
import json
import random
import ssl
import time
import urllib.parse
import uuid
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Final, Generic, Literal, Self, TypeAlias, TypeVar

import httpx

from cryptd_client._wire import _Call
from cryptd_client.errors import (
    CryptdAPIError,
    CryptdConfigurationError,
    CryptdConnectionError,
    api_error,
)
from cryptd_client.signing import CONTENT_TYPE, sign_request

T = TypeVar("T")

DEFAULT_TIMEOUT: Final = 10.0
DEFAULT_RETRIES: Final = 3
DEFAULT_BATCH_SIZE: Final = 1000
BACKOFF_BASE: Final = 0.1  # seconds before the first retry when the server names no delay
MAX_BACKOFF: Final = 10.0  # longest single wait
MAX_TOTAL_WAIT: Final = 30.0  # longest total wait across the retries of one call
# 429 and 503 are cryptd's own "not now". 502 and 504 never come from cryptd: a proxy in front
# of it answers them when cryptd's answer did not reach it (HAProxy closing the sessions of a
# host its checks took out answers 502; no answer in time, 504). Like a lost answer, the
# request may have been served: sent again only when idempotent, as all of these are.
_RETRY_STATUSES: Final = frozenset({429, 502, 503, 504})

# Failures where the request cannot have been processed: no connection, or a kept-alive
# connection the server closed (shutdown, idle timeout) before it sent any response byte.
RETRY_ERRORS: Final = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.RemoteProtocolError,
)
# The subset where no byte of the request left this process: the only failures after which a
# call that changes state (not idempotent) is sent again. A closed kept-alive connection
# (RemoteProtocolError) may have been closed after the server acted on the request.
NEVER_SENT: Final = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# The request left and no answer came: none in time (a host cut off from the network holds
# it until this client's timeout), or the connection broke while waiting (a load balancer
# closing the sessions of a host it took out). The request may have been served, so only an
# idempotent call (crypto, reads) is sent again; a call that changes state raises the error
# as it came, for the caller to check the key.
ANSWER_LOST: Final = (httpx.ReadTimeout, httpx.ReadError)
# What a transport hands back to :meth:`BaseClient._exchange` instead of raising.
CAUGHT: Final = (*RETRY_ERRORS, *ANSWER_LOST)

# One public method's work: a single endpoint call, or a generator that yields the calls
# it needs one after another (each is sent back its result) and returns the method's result.
Plan: TypeAlias = Generator[_Call[Any], Any, T]
# What a transport does: send a request, or sleep this many seconds.
Action: TypeAlias = httpx.Request | float
# What it answers: the response, the failure that may be retried, or None after a sleep.
Outcome: TypeAlias = httpx.Response | httpx.TransportError | None


def _json(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _checked_url(url: str) -> str:
    """``url`` without its trailing slash, refused unless it is an absolute http(s) URL with a
    host and nothing after the path (httpx would fail later, per request, with its own
    error)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except (ValueError, TypeError, AttributeError):
        raise CryptdConfigurationError("url is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CryptdConfigurationError(
            f"url must start with http:// or https:// and name a host, e.g."
            f" https://cryptd.example:8443 (got {url!r})"
            if "@" not in url
            else "url must be http(s)://host[:port] (and hold no user or password)"
        )
    if parts.username is not None or parts.password is not None:
        raise CryptdConfigurationError("url must not hold a user or password")
    if parts.query or parts.fragment:
        raise CryptdConfigurationError("url must not have a query or fragment")
    return url.rstrip("/")


def _decoded_secret(secret_b64: str) -> bytes:
    """The client secret as issued (standard base64) decoded; never echoed in an error."""
    if not isinstance(secret_b64, str | bytes):
        raise CryptdConfigurationError(
            f"secret must be the base64 text the server issued, not {type(secret_b64).__name__}"
        )
    try:
        secret = base64.b64decode(secret_b64, validate=True)
    except (binascii.Error, ValueError):
        raise CryptdConfigurationError(
            "secret is not valid base64: give the client secret exactly as issued"
            " (e.g. the 'secret' of client.json)"
        ) from None
    if not secret:
        raise CryptdConfigurationError("secret is empty")
    return secret


def _error_from(response: httpx.Response) -> CryptdAPIError:
    request_id = response.headers.get("x-request-id")
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "", response.reason_phrase or "unexpected response"
    if not code:
        return CryptdAPIError(response.status_code, "unknown", message, request_id)
    return api_error(response.status_code, code, message, request_id)


def tls_context(
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> ssl.SSLContext:
    """The TLS context of an ``https://`` client: the system's CAs, or only ``ca_file``'s; with
    ``cert_file`` (and ``key_file`` unless the certificate file holds the key) for mutual TLS."""
    context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    if cert_file is not None:
        context.load_cert_chain(str(cert_file), None if key_file is None else str(key_file))
    elif key_file is not None:
        raise ValueError("key_file needs cert_file")
    return context


class Steps(Generic[T]):
    """One public call as the actions a transport carries out: iterate for the actions,
    :meth:`answer` each request with its outcome, then read :attr:`result`. Errors (an API
    error, a connection given up on) are raised from the iteration."""

    result: T

    def __init__(self, actions: Generator[Action, Outcome, T]) -> None:
        self._actions = actions
        self._outcome: Outcome = None

    def answer(self, outcome: Outcome) -> None:
        self._outcome = outcome

    def __iter__(self) -> Iterator[Action]:
        try:
            while True:
                outcome, self._outcome = self._outcome, None
                yield self._actions.send(outcome)
        except StopIteration as done:
            self.result = done.value


class BaseClient:
    """Settings, request building and signing, response reading and the retry decisions of
    both clients. A transport subclass opens its httpx client in :meth:`_open` and carries out
    the :class:`Steps` of each call."""

    _http: httpx.Client | httpx.AsyncClient
    _asynchronous: ClassVar[bool]  # whether the public methods are coroutine methods

    def __init__(
        self,
        url: str,
        client_id: str,
        secret_b64: str | None,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        *,
        max_total_wait: float = MAX_TOTAL_WAIT,
        batch_size: int = DEFAULT_BATCH_SIZE,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
    ) -> None:
        """``secret_b64`` is the client secret as issued (base64): every request is signed
        with it. None: a client the server authenticates by its certificate alone (mutual
        TLS, ``"authentication": "certificate"`` in the server's clients file): requests go
        unsigned over an ``https://`` connection presenting ``cert_file``, which is then
        required. ``retries`` bounds the retries of one call on 429 / 503 / connection
        failure; ``max_total_wait`` (seconds) bounds the time spent waiting between them;
        batches are sent ``batch_size`` items at a time. Key management that changes state
        is never retried after the server may have seen it. Raises
        :class:`CryptdConfigurationError` for a URL or secret that cannot work."""
        self.url = _checked_url(url)
        self.client_id = client_id
        self._secret: bytes | None = None
        if secret_b64 is not None:
            self._secret = _decoded_secret(secret_b64)
        elif cert_file is None or not self.url.startswith("https://"):
            raise CryptdConfigurationError(
                "a client without a secret is authenticated by its TLS client certificate:"
                " it needs an https:// URL and cert_file"
            )
        self.timeout = timeout
        self.retries = retries
        self.max_total_wait = max_total_wait
        self.batch_size = batch_size
        self._tls: ssl.SSLContext | None = None
        if ca_file is not None or cert_file is not None or key_file is not None:
            self._tls = tls_context(ca_file, cert_file, key_file)
        self._open()

    @property
    def authentication(self) -> Literal["signature", "certificate"]:
        """How the server authenticates this client's requests."""
        return "certificate" if self._secret is None else "signature"

    @property
    def _tls_verify(self) -> ssl.SSLContext | bool:
        return True if self._tls is None else self._tls

    def _open(self) -> None:
        raise NotImplementedError

    @classmethod
    def from_file(cls, path: str | Path, **options: Any) -> Self:
        """A client from a credential file ``{"url", "client_id", "secret"}`` (and
        ``ca_file``, ``cert_file``, ``key_file`` for TLS; relative paths are taken from the
        file's directory). A client authenticated by its certificate alone has
        ``"authentication": "certificate"`` and ``cert_file`` instead of a secret. ``url=``
        overrides the file's URL."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CryptdConfigurationError(f"{path}: not a JSON credential file") from None
        if not isinstance(data, dict):
            raise CryptdConfigurationError(f"{path}: not a JSON object")
        missing = [name for name in ("url", "client_id") if not data.get(name)]
        if missing and not (missing == ["url"] and options.get("url")):
            raise CryptdConfigurationError(f"{path}: no {' or '.join(missing)}")
        for name in ("ca_file", "cert_file", "key_file"):
            if data.get(name) is not None and name not in options:
                options[name] = path.parent / data[name]
        url = options.pop("url", None) or data["url"]
        authentication = data.get("authentication", "signature")
        if authentication == "certificate":
            if data.get("secret") is not None:
                raise CryptdConfigurationError(
                    f"{path}: a certificate-only credential has no secret"
                )
            secret = None
        elif authentication == "signature":
            if not data.get("secret"):
                raise CryptdConfigurationError(
                    f'{path}: no secret (or "authentication": "certificate")'
                )
            secret = data["secret"]
        else:
            raise CryptdConfigurationError(
                f"{path}: authentication is 'signature' or 'certificate'"
            )
        try:
            return cls(url, data["client_id"], secret, **options)
        except CryptdConfigurationError as exc:
            raise CryptdConfigurationError(f"{path}: {exc}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, client_id={self.client_id!r})"

    def _request(self, call: _Call[Any]) -> httpx.Request:
        content = b"" if call.payload is None else _json(call.payload)
        # Built afresh for each attempt: a retry carries a new nonce and request id.
        request = self._http.build_request(
            call.method,
            self.url + call.path,
            content=content,
            headers={"X-Request-ID": uuid.uuid4().hex},
        )
        secret = self._secret
        if call.signed and secret is None:
            # Authenticated by the connection's certificate: no signature, the JSON media type.
            if content:
                request.headers["Content-Type"] = CONTENT_TYPE
        elif call.signed and secret is not None:
            # Sign what goes on the wire: the encoded path and query httpx will send.
            path, _, query = request.url.raw_path.decode("ascii").partition("?")
            request.headers.update(
                sign_request(call.method, path, query, content, self.client_id, secret)
            )
        return request

    def _delay(self, attempt: int, waited: float, response: httpx.Response | None) -> float | None:
        """Seconds to wait before retry number ``attempt`` (0-based), or None to give up."""
        if attempt >= self.retries:
            return None
        backoff = BACKOFF_BASE * 2.0**attempt
        server = _retry_after(response) if response is not None else None
        delay = max(backoff, server or 0.0)
        # Jitter (not security relevant) spreads clients that were refused together.
        delay = min(MAX_BACKOFF, delay * (1 + 0.1 * random.random()))  # noqa: S311
        if (server is not None and server > MAX_BACKOFF) or waited + delay > self.max_total_wait:
            return None
        return delay

    @staticmethod
    def _result(call: _Call[T], response: httpx.Response) -> T:
        if response.is_success:
            data = None if response.status_code == 204 or not response.content else response.json()
            return call.parse(data)
        raise _error_from(response)

    def _exchange(self, call: _Call[T]) -> Generator[Action, Outcome, T]:
        """One endpoint call with its retries on 429 / 503 / a connection failure / a lost
        answer; each attempt is signed afresh (new created time and nonce), so a second copy
        of a crypto call is a new request, not a replay. A call that changes state is retried
        only when it never left this process: a 429 or 503 could come from a proxy or a
        server that acted on it, and the API has no idempotency key to make a second copy
        harmless."""
        waited = 0.0
        attempt = 0
        while True:
            started = time.monotonic()
            outcome = yield self._request(call)
            if isinstance(outcome, httpx.Response):
                retried = outcome.status_code in _RETRY_STATUSES and call.idempotent
                delay = self._delay(attempt, waited, outcome) if retried else None
                if delay is None:
                    return self._result(call, outcome)
            elif isinstance(outcome, ANSWER_LOST):
                # The time spent waiting for the lost answer counts toward max_total_wait:
                # a call whose answers keep timing out ends within it, not retries x timeout.
                waited += time.monotonic() - started
                delay = self._delay(attempt, waited, None) if call.idempotent else None
                if delay is None:
                    raise outcome
            else:
                may_retry = call.idempotent or isinstance(outcome, NEVER_SENT)
                delay = self._delay(attempt, waited, None) if may_retry else None
                if delay is None:
                    raise CryptdConnectionError(f"{self.url}: {outcome}") from outcome
            yield delay
            waited += delay
            attempt += 1

    def _steps(self, work: _Call[T] | Plan[T]) -> Steps[T]:
        return Steps(self._exchange(work) if isinstance(work, _Call) else self._run_plan(work))

    def _run_plan(self, plan: Plan[T]) -> Generator[Action, Outcome, T]:
        result: Any = None
        while True:
            try:
                call = plan.send(result)
            except StopIteration as done:
                value: T = done.value
                return value
            result = yield from self._exchange(call)
