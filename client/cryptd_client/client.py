"""The clients: :class:`CryptdClient` (blocking) and :class:`AsyncCryptdClient` share
everything but the transport (httpx's ``Client`` and ``AsyncClient``): each endpoint is
described once in :mod:`cryptd_client._calls`; the two classes only send it, signed, with
retries on 429 / 503 that honour ``Retry-After``."""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import random
import ssl
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Self, TypeVar

import httpx

from cryptd_client._calls import (
    _backup_key,
    _batch,
    _Call,
    _cancel_deletion,
    _chunks,
    _ciphertext_items,
    _create_key,
    _datakey,
    _datakey_result,
    _datakey_wrapped,
    _decrypt,
    _decrypt_result,
    _delete_key,
    _encrypt,
    _encrypt_items,
    _encrypt_result,
    _healthz,
    _hmac,
    _import_key,
    _import_version,
    _key_call,
    _list_keys,
    _mac_result,
    _random,
    _restore_key,
    _rewrap,
    _rotate_key,
    _sign,
    _sign_items,
    _sign_result,
    _update_key,
    _verify,
    _verify_items,
    _verify_mac,
    _verify_result,
    _wrapping_key,
)
from cryptd_client.errors import CryptdAPIError, CryptdConnectionError, api_error
from cryptd_client.results import (
    DataKey,
    DecryptResult,
    EncryptResult,
    KeyMetadata,
    MacResult,
    SignResult,
)
from cryptd_client.signing import CONTENT_TYPE, sign_request

T = TypeVar("T")

DEFAULT_TIMEOUT: Final = 10.0
DEFAULT_RETRIES: Final = 3
DEFAULT_BATCH_SIZE: Final = 1000
BACKOFF_BASE: Final = 0.1  # seconds before the first retry when the server names no delay
MAX_BACKOFF: Final = 10.0  # longest single wait
MAX_TOTAL_WAIT: Final = 30.0  # longest total wait across the retries of one call
_RETRY_STATUSES: Final = frozenset({429, 503})


def _json(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


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


class _Base:
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
        batches are sent ``batch_size`` items at a time."""
        self.url = url.rstrip("/")
        self.client_id = client_id
        self._secret: bytes | None = None
        if secret_b64 is not None:
            self._secret = base64.b64decode(secret_b64, validate=True)
        elif cert_file is None or not self.url.startswith("https://"):
            raise ValueError(
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
        data = json.loads(path.read_text(encoding="utf-8"))
        for name in ("ca_file", "cert_file", "key_file"):
            if data.get(name) is not None and name not in options:
                options[name] = path.parent / data[name]
        url = options.pop("url", None) or data["url"]
        authentication = data.get("authentication", "signature")
        if authentication == "certificate":
            if data.get("secret") is not None:
                raise ValueError(f"{path}: a certificate-only credential has no secret")
            secret = None
        elif authentication == "signature":
            if not data.get("secret"):
                raise ValueError(f'{path}: no secret (or "authentication": "certificate")')
            secret = data["secret"]
        else:
            raise ValueError(f"{path}: authentication is 'signature' or 'certificate'")
        return cls(url, data["client_id"], secret, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, client_id={self.client_id!r})"

    def _build(self, http: httpx.Client | httpx.AsyncClient, call: _Call[Any]) -> httpx.Request:
        content = b"" if call.payload is None else _json(call.payload)
        request = http.build_request(
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
        self._http = httpx.Client(timeout=self.timeout, verify=self._tls_verify)

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
        auto_rotate_period: int | None = None,
        state: str | None = None,
        min_encryption_version: int | None = None,
    ) -> KeyMetadata:
        """Change a key's settings (admin); only the arguments given are sent. ``state``:
        ``enabled``, ``decrypt_only`` or ``disabled``; ``min_encryption_version``: 0 (none)
        or a version from ``min_decryption_version`` to the latest."""
        changes = {
            "min_decryption_version": min_decryption_version,
            "deletion_allowed": deletion_allowed,
            "auto_rotate_period": auto_rotate_period,
            "state": state,
            "min_encryption_version": min_encryption_version,
        }
        return self._run(_update_key(key, changes))

    def delete_key(self, key: str) -> KeyMetadata | None:
        """Delete a key that allows deletion (admin). None: deleted (204). With a waiting
        period on the server (202): the key's metadata, ``state`` ``pending_deletion`` and its
        ``deletion_date``; :meth:`cancel_deletion` undoes it until then."""
        return self._run(_delete_key(key))

    def cancel_deletion(self, key: str) -> KeyMetadata:
        """Undo a scheduled deletion (admin): the key gets back the state it had."""
        return self._run(_cancel_deletion(key))

    def wrapping_key(self) -> str:
        """The PEM of the RSA-4096 key that wraps imported key material (admin)."""
        return self._run(_wrapping_key())

    def import_key(
        self,
        key: str,
        type: str,
        material: bytes,
        *,
        deletion_allowed: bool = False,
        derived: bool = False,
        convergent: bool = False,
    ) -> KeyMetadata:
        """Create ``key`` from ``material`` (raw bytes for secret keys, PKCS#8 DER for private
        keys), wrapped here under the server's wrapping key (admin; needs ``cryptography``)."""
        public_pem = self._run(_wrapping_key())
        flags = {"deletion_allowed": deletion_allowed, "derived": derived, "convergent": convergent}
        return self._run(_import_key(key, public_pem, type, material, flags))

    def import_key_version(self, key: str, material: bytes) -> KeyMetadata:
        """Add a version to ``key`` from ``material``, wrapped here (admin)."""
        public_pem = self._run(_wrapping_key())
        return self._run(_import_version(key, public_pem, material))

    def backup_key(self, key: str) -> str:
        """One opaque blob (base64 text): every version and the metadata, under the master key
        (admin)."""
        return self._run(_backup_key(key))

    def restore_key(self, key: str, backup: str) -> KeyMetadata:
        """Restore what :meth:`backup_key` gave into a cryptd holding the same master key."""
        return self._run(_restore_key(key, backup))

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
        self._http = httpx.AsyncClient(timeout=self.timeout, verify=self._tls_verify)

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
        auto_rotate_period: int | None = None,
        state: str | None = None,
        min_encryption_version: int | None = None,
    ) -> KeyMetadata:
        """Change a key's settings (admin); only the arguments given are sent. ``state``:
        ``enabled``, ``decrypt_only`` or ``disabled``; ``min_encryption_version``: 0 (none)
        or a version from ``min_decryption_version`` to the latest."""
        changes = {
            "min_decryption_version": min_decryption_version,
            "deletion_allowed": deletion_allowed,
            "auto_rotate_period": auto_rotate_period,
            "state": state,
            "min_encryption_version": min_encryption_version,
        }
        return await self._run(_update_key(key, changes))

    async def delete_key(self, key: str) -> KeyMetadata | None:
        """Delete a key that allows deletion (admin). None: deleted (204). With a waiting
        period on the server (202): the key's metadata, ``state`` ``pending_deletion`` and its
        ``deletion_date``; :meth:`cancel_deletion` undoes it until then."""
        return await self._run(_delete_key(key))

    async def cancel_deletion(self, key: str) -> KeyMetadata:
        """Undo a scheduled deletion (admin): the key gets back the state it had."""
        return await self._run(_cancel_deletion(key))

    async def wrapping_key(self) -> str:
        """The PEM of the RSA-4096 key that wraps imported key material (admin)."""
        return await self._run(_wrapping_key())

    async def import_key(
        self,
        key: str,
        type: str,
        material: bytes,
        *,
        deletion_allowed: bool = False,
        derived: bool = False,
        convergent: bool = False,
    ) -> KeyMetadata:
        """Create ``key`` from ``material`` (raw bytes for secret keys, PKCS#8 DER for private
        keys), wrapped here under the server's wrapping key (admin; needs ``cryptography``)."""
        public_pem = await self._run(_wrapping_key())
        flags = {"deletion_allowed": deletion_allowed, "derived": derived, "convergent": convergent}
        return await self._run(_import_key(key, public_pem, type, material, flags))

    async def import_key_version(self, key: str, material: bytes) -> KeyMetadata:
        """Add a version to ``key`` from ``material``, wrapped here (admin)."""
        public_pem = await self._run(_wrapping_key())
        return await self._run(_import_version(key, public_pem, material))

    async def backup_key(self, key: str) -> str:
        """One opaque blob (base64 text): every version and the metadata, under the master key
        (admin)."""
        return await self._run(_backup_key(key))

    async def restore_key(self, key: str, backup: str) -> KeyMetadata:
        """Restore what :meth:`backup_key` gave into a cryptd holding the same master key."""
        return await self._run(_restore_key(key, backup))

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
