"""Python client for cryptd: every request signed (RFC 9421 ``hmac-sha256``), typed results,
typed errors, retries on 429 / 503 that honour ``Retry-After``.

    with CryptdClient.from_file(".cryptd-dev/client.json") as cryptd:
        token = cryptd.encrypt("orders", b"card 4111").ciphertext
        assert cryptd.decrypt("orders", token).plaintext == b"card 4111"

:class:`CryptdClient` (blocking) and :class:`AsyncCryptdClient` share everything but the
transport: each endpoint is described once as a :class:`_Call` (method, path, JSON body,
response parser); the two classes only send it. Binary values go over the wire as base64 and
come back as bytes.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Generic, Self, TypeVar
from urllib.parse import quote

import httpx
import orjson

from service.auth.signature import sign_request

T = TypeVar("T")

DEFAULT_TIMEOUT: Final = 10.0
DEFAULT_RETRIES: Final = 3
DEFAULT_BATCH_SIZE: Final = 1000
BACKOFF_BASE: Final = 0.1  # seconds before the first retry when the server names no delay
MAX_BACKOFF: Final = 10.0  # longest single wait
MAX_TOTAL_WAIT: Final = 30.0  # longest total wait across the retries of one call
_RETRY_STATUSES: Final = frozenset({429, 503})


# --------------------------------------------------------------------------------------------
# Errors


class CryptdAPIError(Exception):
    """The service answered with an error (or a batch item failed)."""

    def __init__(self, status: int, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id


class InvalidRequestError(CryptdAPIError): ...


class DecryptionFailedError(CryptdAPIError): ...


class UnauthenticatedError(CryptdAPIError): ...


class ForbiddenError(CryptdAPIError): ...


class KeyNotFoundError(CryptdAPIError): ...


class NotFoundError(CryptdAPIError): ...


class MethodNotAllowedError(CryptdAPIError): ...


class ConflictError(CryptdAPIError): ...


class PayloadTooLargeError(CryptdAPIError): ...


class RateLimitedError(CryptdAPIError): ...


class OverloadedError(CryptdAPIError): ...


class InternalError(CryptdAPIError): ...


class CryptdConnectionError(Exception):
    """The service could not be reached (after the retries)."""


_ERRORS: Final[Mapping[str, tuple[type[CryptdAPIError], int]]] = {
    "invalid_request": (InvalidRequestError, 400),
    "decryption_failed": (DecryptionFailedError, 400),
    "unauthenticated": (UnauthenticatedError, 401),
    "forbidden": (ForbiddenError, 403),
    "key_not_found": (KeyNotFoundError, 404),
    "not_found": (NotFoundError, 404),
    "method_not_allowed": (MethodNotAllowedError, 405),
    "conflict": (ConflictError, 409),
    "payload_too_large": (PayloadTooLargeError, 413),
    "rate_limited": (RateLimitedError, 429),
    "overloaded": (OverloadedError, 503),
    "internal": (InternalError, 500),
}


def api_error(
    status: int | None, code: str, message: str, request_id: str | None = None
) -> CryptdAPIError:
    """The typed error for ``code``; ``status`` defaults to the code's usual status."""
    cls, usual_status = _ERRORS.get(code, (CryptdAPIError, 500))
    return cls(usual_status if status is None else status, code, message, request_id)


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class EncryptResult:
    ciphertext: str
    key_version: int


@dataclass(frozen=True, slots=True)
class DecryptResult:
    plaintext: bytes = field(repr=False)
    key_version: int


@dataclass(frozen=True, slots=True)
class SignResult:
    signature: bytes
    key_version: int


@dataclass(frozen=True, slots=True)
class MacResult:
    mac: str
    key_version: int


@dataclass(frozen=True, slots=True)
class DataKey:
    plaintext: bytes = field(repr=False)
    ciphertext: str
    key_version: int


@dataclass(frozen=True, slots=True)
class KeyVersion:
    version: int
    created_at: str | None = None
    public_key_pem: str | None = None


@dataclass(frozen=True, slots=True)
class KeyMetadata:
    name: str
    type: str
    latest_version: int
    min_decryption_version: int
    deletion_allowed: bool | None = None
    versions: tuple[KeyVersion, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KeyMetadata:
        return cls(
            name=data["name"],
            type=data["type"],
            latest_version=int(data["latest_version"]),
            min_decryption_version=int(data["min_decryption_version"]),
            deletion_allowed=data.get("deletion_allowed"),
            versions=tuple(
                KeyVersion(
                    version=int(v["version"]),
                    created_at=v.get("created_at"),
                    public_key_pem=v.get("public_key_pem"),
                )
                for v in data.get("versions", ())
            ),
            raw=dict(data),
        )


# --------------------------------------------------------------------------------------------
# Endpoint descriptions, shared by the sync and async clients


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    method: str
    path: str
    payload: Mapping[str, Any] | None
    parse: Callable[[Any], T]
    signed: bool = True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _key_path(operation: str, key: str) -> str:
    # Percent-encode so the signed path is the path on the wire whatever the name holds.
    return f"/v1/{operation}/{quote(key, safe='')}"


def _body(**fields: Any) -> dict[str, Any]:
    """JSON body from keyword fields: None left out, bytes as base64."""
    return {
        name: _b64(value) if isinstance(value, bytes) else value
        for name, value in fields.items()
        if value is not None
    }


def _item(value: Mapping[str, Any]) -> dict[str, Any]:
    return _body(**value)


def _encrypt_result(data: Mapping[str, Any]) -> EncryptResult:
    return EncryptResult(ciphertext=data["ciphertext"], key_version=int(data["key_version"]))


def _decrypt_result(data: Mapping[str, Any]) -> DecryptResult:
    return DecryptResult(plaintext=_unb64(data["plaintext"]), key_version=int(data["key_version"]))


def _sign_result(data: Mapping[str, Any]) -> SignResult:
    return SignResult(signature=_unb64(data["signature"]), key_version=int(data["key_version"]))


def _verify_result(data: Mapping[str, Any]) -> bool:
    valid = data["valid"]
    if not isinstance(valid, bool):
        raise ValueError("'valid' is not a boolean")
    return valid


def _mac_result(data: Mapping[str, Any]) -> MacResult:
    return MacResult(mac=data["mac"], key_version=int(data["key_version"]))


def _datakey_result(data: Mapping[str, Any]) -> DataKey:
    return DataKey(
        plaintext=_unb64(data["plaintext"]),
        ciphertext=data["ciphertext"],
        key_version=int(data["key_version"]),
    )


def _batch_parser(
    parse: Callable[[Mapping[str, Any]], T],
) -> Callable[[Any], list[T | CryptdAPIError]]:
    def parse_batch(data: Mapping[str, Any]) -> list[T | CryptdAPIError]:
        results: list[T | CryptdAPIError] = []
        for item in data["batch"]:
            error = item.get("error")
            if error is not None:
                results.append(api_error(None, error.get("code", ""), error.get("message", "")))
            else:
                results.append(parse(item))
        return results

    return parse_batch


def _exactly_one(message: bytes | None, digest: bytes | None) -> None:
    if (message is None) == (digest is None):
        raise ValueError("give exactly one of message and digest")


def _encrypt(
    key: str,
    plaintext: bytes,
    aad: bytes | None,
    key_version: int | None,
    context: bytes | None = None,
) -> _Call[EncryptResult]:
    body = _body(plaintext=plaintext, aad=aad, key_version=key_version, context=context)
    return _Call("POST", _key_path("encrypt", key), body, _encrypt_result)


def _decrypt(
    key: str,
    ciphertext: str | bytes,
    aad: bytes | None,
    format: str | None,
    key_version: int | None,
    context: bytes | None = None,
) -> _Call[DecryptResult]:
    body = _body(
        ciphertext=ciphertext, aad=aad, format=format, key_version=key_version, context=context
    )
    return _Call("POST", _key_path("decrypt", key), body, _decrypt_result)


def _sign(key: str, fields: Mapping[str, Any]) -> _Call[SignResult]:
    _exactly_one(fields.get("message"), fields.get("digest"))
    return _Call("POST", _key_path("sign", key), _body(**fields), _sign_result)


def _verify(key: str, fields: Mapping[str, Any]) -> _Call[bool]:
    _exactly_one(fields.get("message"), fields.get("digest"))
    return _Call("POST", _key_path("verify", key), _body(**fields), _verify_result)


def _rewrap(
    key: str,
    ciphertext: str,
    aad: bytes | None,
    to_key: str | None,
    context: bytes | None = None,
) -> _Call[EncryptResult]:
    body = _body(ciphertext=ciphertext, aad=aad, to_key=to_key, context=context)
    return _Call("POST", _key_path("rewrap", key), body, _encrypt_result)


def _datakey(
    key: str, bits: int, aad: bytes | None, context: bytes | None = None
) -> _Call[DataKey]:
    body = _body(bits=bits, aad=aad, context=context)
    return _Call("POST", _key_path("datakey", key), body, _datakey_result)


def _datakey_wrapped(
    key: str, bits: int, aad: bytes | None, context: bytes | None
) -> _Call[EncryptResult]:
    body = _body(bits=bits, aad=aad, context=context, plaintext=False)
    return _Call("POST", _key_path("datakey", key), body, _encrypt_result)


def _hmac(
    key: str, message: bytes, key_version: int | None, context: bytes | None
) -> _Call[MacResult]:
    body = _body(message=message, key_version=key_version, context=context)
    return _Call("POST", _key_path("hmac", key), body, _mac_result)


def _verify_mac(
    key: str, message: bytes, mac: str, key_version: int | None, context: bytes | None
) -> _Call[bool]:
    body = _body(message=message, mac=mac, key_version=key_version, context=context)
    return _Call("POST", _key_path("verify", key), body, _verify_result)


def _random(size: int) -> _Call[bytes]:
    return _Call("POST", "/v1/random", {"bytes": size}, lambda data: _unb64(data["random"]))


def _create_key(
    key: str, type: str, deletion_allowed: bool, derived: bool, convergent: bool
) -> _Call[KeyMetadata]:
    body: dict[str, Any] = {"type": type, "deletion_allowed": deletion_allowed}
    if derived:
        body["derived"] = True
    if convergent:
        body["convergent"] = True
    return _key_call("POST", key, body)


def _list_keys() -> _Call[list[KeyMetadata]]:
    return _Call(
        "GET", "/v1/keys", None, lambda data: [KeyMetadata.from_json(k) for k in data["keys"]]
    )


def _key_call(method: str, key: str, body: Mapping[str, Any] | None) -> _Call[KeyMetadata]:
    return _Call(method, _key_path("keys", key), body, KeyMetadata.from_json)


def _update_key(
    key: str, min_decryption_version: int | None, deletion_allowed: bool | None
) -> _Call[KeyMetadata]:
    body = _body(min_decryption_version=min_decryption_version, deletion_allowed=deletion_allowed)
    if not body:
        raise ValueError("give min_decryption_version and/or deletion_allowed")
    return _key_call("PATCH", key, body)


def _rotate_key(key: str) -> _Call[KeyMetadata]:
    return _Call("POST", _key_path("keys", key) + "/rotate", None, KeyMetadata.from_json)


def _delete_key(key: str) -> _Call[None]:
    return _Call("DELETE", _key_path("keys", key), None, lambda _data: None)


def _healthz() -> _Call[dict[str, Any]]:
    return _Call("GET", "/healthz", None, lambda data: dict(data or {}), signed=False)


def _batch(
    operation: str,
    key: str,
    items: Sequence[Mapping[str, Any]],
    parse: Callable[[Mapping[str, Any]], T],
) -> _Call[list[T | CryptdAPIError]]:
    body = {"batch": [_item(item) for item in items]}
    return _Call("POST", _key_path(operation, key), body, _batch_parser(parse))


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _encrypt_items(items: Sequence[bytes | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [{"plaintext": i} if isinstance(i, bytes) else i for i in items]


def _ciphertext_items(items: Sequence[str | bytes | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [{"ciphertext": i} if isinstance(i, str | bytes) else i for i in items]


def _sign_items(items: Sequence[bytes | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [{"message": i} if isinstance(i, bytes) else i for i in items]


def _verify_items(
    items: Sequence[tuple[bytes, bytes] | Mapping[str, Any]],
) -> list[Mapping[str, Any]]:
    return [{"message": i[0], "signature": i[1]} if isinstance(i, tuple) else i for i in items]


# --------------------------------------------------------------------------------------------
# Transport-independent part of the clients


# Failures where the request cannot have been processed: no connection, or a kept-alive
# connection the server closed (shutdown, idle timeout) before it sent any response byte.
_RETRY_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.RemoteProtocolError,
)


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


class _Base:
    def __init__(
        self,
        url: str,
        client_id: str,
        secret_b64: str,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        *,
        max_total_wait: float = MAX_TOTAL_WAIT,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        """``secret_b64`` is the client secret as issued (base64). ``retries`` bounds the
        retries of one call on 429 / 503 / connection failure; ``max_total_wait`` (seconds)
        bounds the time spent waiting between them; batches are sent ``batch_size`` items at a
        time."""
        self.url = url.rstrip("/")
        self.client_id = client_id
        self._secret = base64.b64decode(secret_b64, validate=True)
        self.timeout = timeout
        self.retries = retries
        self.max_total_wait = max_total_wait
        self.batch_size = batch_size
        self._open()

    def _open(self) -> None:
        raise NotImplementedError

    @classmethod
    def from_file(cls, path: str | Path, **options: Any) -> Self:
        """A client from a credential file ``{"url", "client_id", "secret"}``."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(data["url"], data["client_id"], data["secret"], **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, client_id={self.client_id!r})"

    def _build(self, http: httpx.Client | httpx.AsyncClient, call: _Call[Any]) -> httpx.Request:
        content = b"" if call.payload is None else orjson.dumps(call.payload)
        request = http.build_request(
            call.method,
            self.url + call.path,
            content=content,
            headers={"X-Request-ID": uuid.uuid4().hex},
        )
        if call.signed:
            # Sign what goes on the wire: the encoded path and query httpx will send.
            path, _, query = request.url.raw_path.decode("ascii").partition("?")
            request.headers.update(
                sign_request(call.method, path, query, content, self.client_id, self._secret)
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


# --------------------------------------------------------------------------------------------
# Blocking client


class CryptdClient(_Base):
    """Blocking client. One keep-alive connection pool per instance; close it when done."""

    _http: httpx.Client

    def _open(self) -> None:
        self._http = httpx.Client(timeout=self.timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, call: _Call[T]) -> T:
        waited = 0.0
        attempt = 0
        while True:
            try:
                response = self._http.send(self._build(self._http, call))  # fresh nonce each time
            except _RETRY_ERRORS as exc:
                delay = self._delay(attempt, waited, None)
                if delay is None:
                    raise CryptdConnectionError(f"{self.url}: {exc}") from exc
            else:
                delay = (
                    self._delay(attempt, waited, response)
                    if response.status_code in _RETRY_STATUSES
                    else None
                )
                if delay is None:
                    return self._result(call, response)
            time.sleep(delay)
            waited += delay
            attempt += 1

    def encrypt(
        self,
        key: str,
        plaintext: bytes,
        *,
        aad: bytes | None = None,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> EncryptResult:
        return self._run(_encrypt(key, plaintext, aad, key_version, context))

    def decrypt(
        self,
        key: str,
        ciphertext: str | bytes,
        *,
        aad: bytes | None = None,
        format: str | None = None,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> DecryptResult:
        return self._run(_decrypt(key, ciphertext, aad, format, key_version, context))

    def sign(
        self,
        key: str,
        message: bytes | None = None,
        *,
        digest: bytes | None = None,
        algorithm: str | None = None,
        signer_id: str | None = None,
        encoding: str | None = None,
        key_version: int | None = None,
        hash_algorithm: str | None = None,
    ) -> SignResult:
        return self._run(
            _sign(
                key,
                {
                    "message": message,
                    "digest": digest,
                    "algorithm": algorithm,
                    "signer_id": signer_id,
                    "encoding": encoding,
                    "key_version": key_version,
                    "hash_algorithm": hash_algorithm,
                },
            )
        )

    def verify(
        self,
        key: str,
        message: bytes | None = None,
        *,
        signature: bytes,
        digest: bytes | None = None,
        algorithm: str | None = None,
        signer_id: str | None = None,
        encoding: str | None = None,
        key_version: int | None = None,
        hash_algorithm: str | None = None,
    ) -> bool:
        return self._run(
            _verify(
                key,
                {
                    "message": message,
                    "digest": digest,
                    "signature": signature,
                    "algorithm": algorithm,
                    "signer_id": signer_id,
                    "encoding": encoding,
                    "key_version": key_version,
                    "hash_algorithm": hash_algorithm,
                },
            )
        )

    def hmac(
        self,
        key: str,
        message: bytes,
        *,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> MacResult:
        return self._run(_hmac(key, message, key_version, context))

    def verify_mac(
        self,
        key: str,
        message: bytes,
        mac: str,
        *,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> bool:
        return self._run(_verify_mac(key, message, mac, key_version, context))

    def random(self, size: int) -> bytes:
        """``size`` (1 to 65,536) bytes from the server's CSPRNG."""
        return self._run(_random(size))

    def rewrap(
        self,
        key: str,
        ciphertext: str,
        *,
        aad: bytes | None = None,
        to_key: str | None = None,
        context: bytes | None = None,
    ) -> EncryptResult:
        return self._run(_rewrap(key, ciphertext, aad, to_key, context))

    def datakey(
        self,
        key: str,
        bits: int = 256,
        aad: bytes | None = None,
        *,
        context: bytes | None = None,
    ) -> DataKey:
        return self._run(_datakey(key, bits, aad, context))

    def datakey_wrapped(
        self,
        key: str,
        bits: int = 256,
        aad: bytes | None = None,
        *,
        context: bytes | None = None,
    ) -> EncryptResult:
        """A fresh data key, returned only wrapped (``plaintext: false``)."""
        return self._run(_datakey_wrapped(key, bits, aad, context))

    def list_keys(self) -> list[KeyMetadata]:
        return self._run(_list_keys())

    def get_key(self, key: str) -> KeyMetadata:
        return self._run(_key_call("GET", key, None))

    def create_key(
        self,
        key: str,
        type: str,
        deletion_allowed: bool = False,
        *,
        derived: bool = False,
        convergent: bool = False,
    ) -> KeyMetadata:
        return self._run(_create_key(key, type, deletion_allowed, derived, convergent))

    def rotate_key(self, key: str) -> KeyMetadata:
        return self._run(_rotate_key(key))

    def update_key(
        self,
        key: str,
        *,
        min_decryption_version: int | None = None,
        deletion_allowed: bool | None = None,
    ) -> KeyMetadata:
        return self._run(_update_key(key, min_decryption_version, deletion_allowed))

    def delete_key(self, key: str) -> None:
        self._run(_delete_key(key))

    def healthz(self) -> dict[str, Any]:
        return self._run(_healthz())

    def _run_batches(
        self,
        operation: str,
        key: str,
        items: Sequence[Mapping[str, Any]],
        parse: Callable[[Mapping[str, Any]], T],
    ) -> list[T | CryptdAPIError]:
        results: list[T | CryptdAPIError] = []
        for chunk in _chunks(items, self.batch_size):
            batch: list[T | CryptdAPIError] = self._run(_batch(operation, key, chunk, parse))
            results.extend(batch)
        return results

    def encrypt_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> list[EncryptResult | CryptdAPIError]:
        """Items are plaintexts or ``{"plaintext", "aad"?, "key_version"?}`` mappings."""
        return self._run_batches("encrypt", key, _encrypt_items(items), _encrypt_result)

    def decrypt_batch(
        self, key: str, items: Sequence[str | bytes | Mapping[str, Any]]
    ) -> list[DecryptResult | CryptdAPIError]:
        """Items are ciphertexts or ``{"ciphertext", "aad"?, "format"?, ...}`` mappings."""
        return self._run_batches("decrypt", key, _ciphertext_items(items), _decrypt_result)

    def sign_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> list[SignResult | CryptdAPIError]:
        """Items are messages or ``{"message" | "digest", "algorithm"?, ...}`` mappings."""
        return self._run_batches("sign", key, _sign_items(items), _sign_result)

    def verify_batch(
        self, key: str, items: Sequence[tuple[bytes, bytes] | Mapping[str, Any]]
    ) -> list[bool | CryptdAPIError]:
        """Items are ``(message, signature)`` pairs or request mappings."""
        return self._run_batches("verify", key, _verify_items(items), _verify_result)

    def rewrap_batch(
        self, key: str, items: Sequence[str | Mapping[str, Any]]
    ) -> list[EncryptResult | CryptdAPIError]:
        return self._run_batches("rewrap", key, _ciphertext_items(items), _encrypt_result)

    def hmac_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> list[MacResult | CryptdAPIError]:
        """Items are messages or ``{"message", "key_version"?, "context"?}`` mappings."""
        return self._run_batches("hmac", key, _sign_items(items), _mac_result)

    def datakey_batch(
        self, key: str, items: Sequence[Mapping[str, Any]]
    ) -> list[DataKey | EncryptResult | CryptdAPIError]:
        """Items are ``{"bits"?, "aad"?, "plaintext"?, "context"?}`` mappings; an item with
        ``"plaintext": False`` gives an EncryptResult (the wrapped key only)."""

        def parse(data: Mapping[str, Any]) -> DataKey | EncryptResult:
            return _datakey_result(data) if "plaintext" in data else _encrypt_result(data)

        return self._run_batches("datakey", key, items, parse)


# --------------------------------------------------------------------------------------------
# Async client (same methods, awaited)


class AsyncCryptdClient(_Base):
    """asyncio client. One keep-alive connection pool per instance; ``aclose()`` it when done."""

    _http: httpx.AsyncClient

    def _open(self) -> None:
        self._http = httpx.AsyncClient(timeout=self.timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run(self, call: _Call[T]) -> T:
        waited = 0.0
        attempt = 0
        while True:
            try:
                response = await self._http.send(self._build(self._http, call))
            except _RETRY_ERRORS as exc:
                delay = self._delay(attempt, waited, None)
                if delay is None:
                    raise CryptdConnectionError(f"{self.url}: {exc}") from exc
            else:
                delay = (
                    self._delay(attempt, waited, response)
                    if response.status_code in _RETRY_STATUSES
                    else None
                )
                if delay is None:
                    return self._result(call, response)
            await asyncio.sleep(delay)
            waited += delay
            attempt += 1

    async def encrypt(
        self,
        key: str,
        plaintext: bytes,
        *,
        aad: bytes | None = None,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> EncryptResult:
        return await self._run(_encrypt(key, plaintext, aad, key_version, context))

    async def decrypt(
        self,
        key: str,
        ciphertext: str | bytes,
        *,
        aad: bytes | None = None,
        format: str | None = None,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> DecryptResult:
        return await self._run(_decrypt(key, ciphertext, aad, format, key_version, context))

    async def sign(
        self,
        key: str,
        message: bytes | None = None,
        *,
        digest: bytes | None = None,
        algorithm: str | None = None,
        signer_id: str | None = None,
        encoding: str | None = None,
        key_version: int | None = None,
        hash_algorithm: str | None = None,
    ) -> SignResult:
        return await self._run(
            _sign(
                key,
                {
                    "message": message,
                    "digest": digest,
                    "algorithm": algorithm,
                    "signer_id": signer_id,
                    "encoding": encoding,
                    "key_version": key_version,
                    "hash_algorithm": hash_algorithm,
                },
            )
        )

    async def verify(
        self,
        key: str,
        message: bytes | None = None,
        *,
        signature: bytes,
        digest: bytes | None = None,
        algorithm: str | None = None,
        signer_id: str | None = None,
        encoding: str | None = None,
        key_version: int | None = None,
        hash_algorithm: str | None = None,
    ) -> bool:
        return await self._run(
            _verify(
                key,
                {
                    "message": message,
                    "digest": digest,
                    "signature": signature,
                    "algorithm": algorithm,
                    "signer_id": signer_id,
                    "encoding": encoding,
                    "key_version": key_version,
                    "hash_algorithm": hash_algorithm,
                },
            )
        )

    async def hmac(
        self,
        key: str,
        message: bytes,
        *,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> MacResult:
        return await self._run(_hmac(key, message, key_version, context))

    async def verify_mac(
        self,
        key: str,
        message: bytes,
        mac: str,
        *,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> bool:
        return await self._run(_verify_mac(key, message, mac, key_version, context))

    async def random(self, size: int) -> bytes:
        """``size`` (1 to 65,536) bytes from the server's CSPRNG."""
        return await self._run(_random(size))

    async def rewrap(
        self,
        key: str,
        ciphertext: str,
        *,
        aad: bytes | None = None,
        to_key: str | None = None,
        context: bytes | None = None,
    ) -> EncryptResult:
        return await self._run(_rewrap(key, ciphertext, aad, to_key, context))

    async def datakey(
        self,
        key: str,
        bits: int = 256,
        aad: bytes | None = None,
        *,
        context: bytes | None = None,
    ) -> DataKey:
        return await self._run(_datakey(key, bits, aad, context))

    async def datakey_wrapped(
        self,
        key: str,
        bits: int = 256,
        aad: bytes | None = None,
        *,
        context: bytes | None = None,
    ) -> EncryptResult:
        """A fresh data key, returned only wrapped (``plaintext: false``)."""
        return await self._run(_datakey_wrapped(key, bits, aad, context))

    async def list_keys(self) -> list[KeyMetadata]:
        return await self._run(_list_keys())

    async def get_key(self, key: str) -> KeyMetadata:
        return await self._run(_key_call("GET", key, None))

    async def create_key(
        self,
        key: str,
        type: str,
        deletion_allowed: bool = False,
        *,
        derived: bool = False,
        convergent: bool = False,
    ) -> KeyMetadata:
        return await self._run(_create_key(key, type, deletion_allowed, derived, convergent))

    async def rotate_key(self, key: str) -> KeyMetadata:
        return await self._run(_rotate_key(key))

    async def update_key(
        self,
        key: str,
        *,
        min_decryption_version: int | None = None,
        deletion_allowed: bool | None = None,
    ) -> KeyMetadata:
        return await self._run(_update_key(key, min_decryption_version, deletion_allowed))

    async def delete_key(self, key: str) -> None:
        await self._run(_delete_key(key))

    async def healthz(self) -> dict[str, Any]:
        return await self._run(_healthz())

    async def _run_batches(
        self,
        operation: str,
        key: str,
        items: Sequence[Mapping[str, Any]],
        parse: Callable[[Mapping[str, Any]], T],
    ) -> list[T | CryptdAPIError]:
        results: list[T | CryptdAPIError] = []
        for chunk in _chunks(items, self.batch_size):
            batch: list[T | CryptdAPIError] = await self._run(_batch(operation, key, chunk, parse))
            results.extend(batch)
        return results

    async def encrypt_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> list[EncryptResult | CryptdAPIError]:
        return await self._run_batches("encrypt", key, _encrypt_items(items), _encrypt_result)

    async def decrypt_batch(
        self, key: str, items: Sequence[str | bytes | Mapping[str, Any]]
    ) -> list[DecryptResult | CryptdAPIError]:
        return await self._run_batches("decrypt", key, _ciphertext_items(items), _decrypt_result)

    async def sign_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> list[SignResult | CryptdAPIError]:
        return await self._run_batches("sign", key, _sign_items(items), _sign_result)

    async def verify_batch(
        self, key: str, items: Sequence[tuple[bytes, bytes] | Mapping[str, Any]]
    ) -> list[bool | CryptdAPIError]:
        return await self._run_batches("verify", key, _verify_items(items), _verify_result)

    async def rewrap_batch(
        self, key: str, items: Sequence[str | Mapping[str, Any]]
    ) -> list[EncryptResult | CryptdAPIError]:
        return await self._run_batches("rewrap", key, _ciphertext_items(items), _encrypt_result)

    async def hmac_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> list[MacResult | CryptdAPIError]:
        """Items are messages or ``{"message", "key_version"?, "context"?}`` mappings."""
        return await self._run_batches("hmac", key, _sign_items(items), _mac_result)

    async def datakey_batch(
        self, key: str, items: Sequence[Mapping[str, Any]]
    ) -> list[DataKey | EncryptResult | CryptdAPIError]:
        """Items are ``{"bits"?, "aad"?, "plaintext"?, "context"?}`` mappings; an item with
        ``"plaintext": False`` gives an EncryptResult (the wrapped key only)."""

        def parse(data: Mapping[str, Any]) -> DataKey | EncryptResult:
            return _datakey_result(data) if "plaintext" in data else _encrypt_result(data)

        return await self._run_batches("datakey", key, items, parse)
