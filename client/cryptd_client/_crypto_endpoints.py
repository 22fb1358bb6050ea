"""The cryptographic operations of both clients, each written once: encrypt, decrypt, sign,
verify, HMAC, random bytes, rewrap, data keys, KEM encapsulation, and their batches (sent
``batch_size`` items at a time)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from cryptd_client._base import BaseClient, Plan
from cryptd_client._methods import operation
from cryptd_client._wire import (
    _b64,
    _batch_parser,
    _body,
    _Call,
    _datakey_result,
    _decrypt_result,
    _encapsulation,
    _encrypt_result,
    _item,
    _key_path,
    _mac_result,
    _shared_secret,
    _sign_result,
    _unb64,
    _verify_result,
)
from cryptd_client.errors import CryptdAPIError
from cryptd_client.results import (
    DataKey,
    DecryptResult,
    Encapsulation,
    EncryptResult,
    MacResult,
    SharedSecret,
    SignResult,
)

T = TypeVar("T")
# A batch request is also cut where its items reach this many bytes: under the service's
# default 1 MiB body limit whatever the tokens' size (an X-Wing token is about 1.6 KB, so a
# thousand of them would be refused with 413).
MAX_BATCH_BYTES: Final = 768 * 1024


def _exactly_one(message: bytes | None, digest: bytes | None) -> None:
    if (message is None) == (digest is None):
        raise ValueError("give exactly one of message and digest")


def _signing_body(
    message: bytes | None,
    digest: bytes | None,
    signature: bytes | None,
    algorithm: str | None,
    signer_id: str | None,
    encoding: str | None,
    key_version: int | None,
    hash_algorithm: str | None,
    context: bytes | None = None,
    message_type: str | None = None,
) -> dict[str, Any]:
    """The body of sign (``signature`` None) and of verify, in the order both send it.
    ``context`` and ``message_type``: ML-DSA keys (FIPS 204 context; ``external_mu``)."""
    _exactly_one(message, digest)
    return _body(
        message=message,
        digest=digest,
        signature=signature,
        algorithm=algorithm,
        signer_id=signer_id,
        encoding=encoding,
        key_version=key_version,
        hash_algorithm=hash_algorithm,
        context=context,
        message_type=message_type,
    )


def _batches(
    operation: str,
    key: str,
    items: Sequence[Mapping[str, Any]],
    parse: Callable[[Mapping[str, Any]], T],
    size: int,
) -> Plan[list[T | CryptdAPIError]]:
    results: list[T | CryptdAPIError] = []
    chunk: list[dict[str, Any]] = []
    chunk_bytes = 0
    for item in items:
        wire = _item(item)
        item_bytes = _wire_size(wire)
        if chunk and (len(chunk) >= size or chunk_bytes + item_bytes > MAX_BATCH_BYTES):
            batch: list[T | CryptdAPIError] = yield _batch_call(operation, key, chunk, parse)
            results.extend(batch)
            chunk, chunk_bytes = [], 0
        chunk.append(wire)
        chunk_bytes += item_bytes
    if chunk:
        results.extend((yield _batch_call(operation, key, chunk, parse)))
    return results


def _batch_call(
    operation: str, key: str, chunk: list[dict[str, Any]], parse: Callable[[Mapping[str, Any]], T]
) -> _Call[list[T | CryptdAPIError]]:
    return _Call("POST", _key_path(operation, key), {"batch": chunk}, _batch_parser(parse))


def _wire_size(item: Mapping[str, Any]) -> int:
    """About the JSON size of one wire item (its values are str, int or bool)."""
    return sum(len(name) + len(str(value)) + 8 for name, value in item.items())


def _as_items(field: str, items: Sequence[Any]) -> list[Mapping[str, Any]]:
    """Batch items given bare (a plaintext, a ciphertext, a message) as ``{field: item}``."""
    return [item if isinstance(item, Mapping) else {field: item} for item in items]


def _ciphertext_text(ciphertext: Any) -> str:
    """A KEM ciphertext is raw bytes, sent as base64 (a token's ``str`` is not one)."""
    if not isinstance(ciphertext, bytes | bytearray | memoryview):
        raise TypeError(f"a KEM ciphertext is bytes, not {type(ciphertext).__name__}")
    return _b64(ciphertext)


def _datakey_item_result(data: Mapping[str, Any]) -> DataKey | EncryptResult:
    return _datakey_result(data) if "plaintext" in data else _encrypt_result(data)


class CryptoEndpoints(BaseClient):
    """The cryptographic operations: one endpoint call each, or a batch of them."""

    @operation
    def encrypt(
        self,
        key: str,
        plaintext: bytes,
        *,
        aad: bytes | None = None,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> _Call[EncryptResult]:
        body = _body(plaintext=plaintext, aad=aad, key_version=key_version, context=context)
        return _Call("POST", _key_path("encrypt", key), body, _encrypt_result)

    @operation
    def decrypt(
        self,
        key: str,
        ciphertext: str | bytes,
        *,
        aad: bytes | None = None,
        format: str | None = None,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> _Call[DecryptResult]:
        body = _body(
            ciphertext=ciphertext, aad=aad, format=format, key_version=key_version, context=context
        )
        return _Call("POST", _key_path("decrypt", key), body, _decrypt_result)

    @operation
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
        context: bytes | None = None,
        message_type: str | None = None,
    ) -> _Call[SignResult]:
        options = (algorithm, signer_id, encoding, key_version, hash_algorithm)
        body = _signing_body(message, digest, None, *options, context, message_type)
        return _Call("POST", _key_path("sign", key), body, _sign_result)

    @operation
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
        context: bytes | None = None,
        message_type: str | None = None,
    ) -> _Call[bool]:
        options = (algorithm, signer_id, encoding, key_version, hash_algorithm)
        body = _signing_body(message, digest, signature, *options, context, message_type)
        return _Call("POST", _key_path("verify", key), body, _verify_result)

    @operation
    def hmac(
        self,
        key: str,
        message: bytes,
        *,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> _Call[MacResult]:
        body = _body(message=message, key_version=key_version, context=context)
        return _Call("POST", _key_path("hmac", key), body, _mac_result)

    @operation
    def verify_mac(
        self,
        key: str,
        message: bytes,
        mac: str,
        *,
        key_version: int | None = None,
        context: bytes | None = None,
    ) -> _Call[bool]:
        body = _body(message=message, mac=mac, key_version=key_version, context=context)
        return _Call("POST", _key_path("verify", key), body, _verify_result)

    @operation
    def random(self, size: int) -> _Call[bytes]:
        """``size`` (1 to 65,536) bytes from the server's CSPRNG."""
        return _Call("POST", "/v1/random", _body(bytes=size), lambda data: _unb64(data["random"]))

    @operation
    def rewrap(
        self,
        key: str,
        ciphertext: str,
        *,
        aad: bytes | None = None,
        to_key: str | None = None,
        context: bytes | None = None,
    ) -> _Call[EncryptResult]:
        body = _body(ciphertext=ciphertext, aad=aad, to_key=to_key, context=context)
        return _Call("POST", _key_path("rewrap", key), body, _encrypt_result)

    @operation
    def datakey(
        self,
        key: str,
        bits: int = 256,
        aad: bytes | None = None,
        *,
        context: bytes | None = None,
    ) -> _Call[DataKey]:
        body = _body(bits=bits, aad=aad, context=context)
        return _Call("POST", _key_path("datakey", key), body, _datakey_result)

    @operation
    def datakey_wrapped(
        self,
        key: str,
        bits: int = 256,
        aad: bytes | None = None,
        *,
        context: bytes | None = None,
    ) -> _Call[EncryptResult]:
        """A fresh data key, returned only wrapped (``plaintext: false``)."""
        body = _body(bits=bits, aad=aad, context=context, plaintext=False)
        return _Call("POST", _key_path("datakey", key), body, _encrypt_result)

    @operation
    def encapsulate(self, key: str) -> _Call[Encapsulation]:
        """A fresh shared secret and its KEM ciphertext under a KEM key's latest version
        (ml-kem-768, ml-kem-1024, x25519-ml-kem-768)."""
        return _Call("POST", _key_path("encapsulate", key), {}, _encapsulation)

    @operation
    def decapsulate(
        self, key: str, ciphertext: bytes, *, key_version: int | None = None
    ) -> _Call[SharedSecret]:
        """The shared secret of a KEM ciphertext (raw bytes, as ``encapsulate`` gave them).
        ML-KEM rejects implicitly: a ciphertext for another key gives another secret, not an
        error; a ciphertext of the wrong length is 400 ``invalid_request``."""
        body = _body(ciphertext=_ciphertext_text(ciphertext), key_version=key_version)
        return _Call("POST", _key_path("decapsulate", key), body, _shared_secret)

    @operation
    def encrypt_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> Plan[list[EncryptResult | CryptdAPIError]]:
        """Items are plaintexts or ``{"plaintext", "aad"?, "key_version"?}`` mappings."""
        mappings = _as_items("plaintext", items)
        return _batches("encrypt", key, mappings, _encrypt_result, self.batch_size)

    @operation
    def decrypt_batch(
        self, key: str, items: Sequence[str | bytes | Mapping[str, Any]]
    ) -> Plan[list[DecryptResult | CryptdAPIError]]:
        """Items are ciphertexts or ``{"ciphertext", "aad"?, "format"?, ...}`` mappings."""
        mappings = _as_items("ciphertext", items)
        return _batches("decrypt", key, mappings, _decrypt_result, self.batch_size)

    @operation
    def sign_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> Plan[list[SignResult | CryptdAPIError]]:
        """Items are messages or ``{"message" | "digest", "algorithm"?, ...}`` mappings."""
        mappings = _as_items("message", items)
        return _batches("sign", key, mappings, _sign_result, self.batch_size)

    @operation
    def verify_batch(
        self, key: str, items: Sequence[tuple[bytes, bytes] | Mapping[str, Any]]
    ) -> Plan[list[bool | CryptdAPIError]]:
        """Items are ``(message, signature)`` pairs or request mappings."""
        mappings = [
            {"message": i[0], "signature": i[1]} if isinstance(i, tuple) else i for i in items
        ]
        return _batches("verify", key, mappings, _verify_result, self.batch_size)

    @operation
    def rewrap_batch(
        self, key: str, items: Sequence[str | Mapping[str, Any]]
    ) -> Plan[list[EncryptResult | CryptdAPIError]]:
        mappings = _as_items("ciphertext", items)
        return _batches("rewrap", key, mappings, _encrypt_result, self.batch_size)

    @operation
    def hmac_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> Plan[list[MacResult | CryptdAPIError]]:
        """Items are messages or ``{"message", "key_version"?, "context"?}`` mappings."""
        mappings = _as_items("message", items)
        return _batches("hmac", key, mappings, _mac_result, self.batch_size)

    @operation
    def encapsulate_batch(self, key: str, count: int) -> Plan[list[Encapsulation | CryptdAPIError]]:
        """``count`` encapsulations in batch requests."""
        return _batches("encapsulate", key, [{}] * count, _encapsulation, self.batch_size)

    @operation
    def decapsulate_batch(
        self, key: str, items: Sequence[bytes | Mapping[str, Any]]
    ) -> Plan[list[SharedSecret | CryptdAPIError]]:
        """Items are KEM ciphertexts (bytes) or ``{"ciphertext", "key_version"?}`` mappings."""
        mappings = [
            {**i, "ciphertext": _ciphertext_text(i["ciphertext"])}
            if isinstance(i, Mapping)
            else {"ciphertext": _ciphertext_text(i)}
            for i in items
        ]
        return _batches("decapsulate", key, mappings, _shared_secret, self.batch_size)

    @operation
    def datakey_batch(
        self, key: str, items: Sequence[Mapping[str, Any]]
    ) -> Plan[list[DataKey | EncryptResult | CryptdAPIError]]:
        """Items are ``{"bits"?, "aad"?, "plaintext"?, "context"?}`` mappings; an item with
        ``"plaintext": False`` gives an EncryptResult (the wrapped key only)."""
        return _batches("datakey", key, items, _datakey_item_result, self.batch_size)
