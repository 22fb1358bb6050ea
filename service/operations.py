"""The crypto operations over a keyring snapshot: pure, synchronous, one item at a time.

A single request is a batch of one: :func:`run_batch` runs every item through the single-item
function and turns per-item failures into error entries, so one bad item never fails the others.
The same functions run inline, in a thread, or inside a pool worker process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service import b64 as b64codec
from service.crypto.base import (
    NO_OPTIONS,
    InvalidCiphertext,
    InvalidOptions,
    KeyHandle,
    SignOptions,
    UnsupportedOperation,
)
from service.errors import CryptdError, DecryptionFailed, Internal, InvalidRequest
from service.keys import token
from service.keys.keyring import Key, Keyring, KeyVersion

log = logging.getLogger("cryptd.engine")

OpName = Literal[
    "encrypt",
    "decrypt",
    "sign",
    "verify",
    "rewrap",
    "datakey",
    "hmac",
    "encapsulate",
    "decapsulate",
]
Result = dict[str, Any]
# observer(operation, key_type, seconds, outcome, items)
Observer = Callable[[str, str, float, str, int], None]


@dataclass(frozen=True, slots=True)
class EncryptItem:
    plaintext: bytes
    aad: bytes = b""
    key_version: int | None = None
    context: bytes | None = None  # derived keys only


@dataclass(frozen=True, slots=True)
class DecryptItem:
    ciphertext: str
    aad: bytes = b""
    format: str | None = None
    key_version: int | None = None
    context: bytes | None = None


@dataclass(frozen=True, slots=True)
class SignItem:
    data: bytes
    prehashed: bool = False
    options: SignOptions = NO_OPTIONS
    key_version: int | None = None


@dataclass(frozen=True, slots=True)
class VerifyItem:
    signature: bytes
    data: bytes
    prehashed: bool = False
    options: SignOptions = NO_OPTIONS
    key_version: int | None = None


@dataclass(frozen=True, slots=True)
class MacVerifyItem:
    """``verify`` with ``mac`` (HMAC keys) instead of ``signature``."""

    mac: str
    data: bytes
    key_version: int | None = None
    context: bytes | None = None


@dataclass(frozen=True, slots=True)
class RewrapItem:
    ciphertext: str
    aad: bytes = b""
    to_key: str | None = None
    context: bytes | None = None  # for whichever of the two keys is derived


@dataclass(frozen=True, slots=True)
class DatakeyItem:
    bits: int = 256
    aad: bytes = b""
    plaintext: bool = True  # False: the wrapped key only (KMS GenerateDataKeyWithoutPlaintext)
    context: bytes | None = None


@dataclass(frozen=True, slots=True)
class HmacItem:
    data: bytes
    key_version: int | None = None
    context: bytes | None = None


@dataclass(frozen=True, slots=True)
class EncapsulateItem:
    """KEM keys: a fresh shared secret and its ciphertext, under the active version."""


@dataclass(frozen=True, slots=True)
class DecapsulateItem:
    ciphertext: bytes
    key_version: int | None = None


Item = (
    EncryptItem
    | DecryptItem
    | SignItem
    | VerifyItem
    | MacVerifyItem
    | RewrapItem
    | DatakeyItem
    | HmacItem
    | EncapsulateItem
    | DecapsulateItem
)

# Which key capability each API operation needs.
REQUIRES: dict[OpName, str] = {
    "encrypt": "encrypt",
    "decrypt": "decrypt",
    "sign": "sign",
    "verify": "verify",
    "rewrap": "decrypt",
    "datakey": "encrypt",
    "hmac": "hmac",
    "encapsulate": "encapsulate",
    "decapsulate": "decapsulate",
}


def b64(data: bytes) -> str:
    return b64codec.encode(data)


def check_operation(key: Key, op: OpName) -> None:
    """Refuse an operation the key's type does not support (400), then one its state does not
    allow (409 key_disabled): both concern the whole request, never one item."""
    if not key.type.supports(REQUIRES[op]):  # type: ignore[arg-type]
        raise InvalidRequest(f"key type {key.type.name} does not support {op}")
    key.check_use(op)


def _handle(kv: KeyVersion, context: bytes | None) -> KeyHandle:
    """The version's key, or the key derived for ``context``: a context on a key that is not
    derived, or none on one that is, is refused by the handle (400)."""
    return kv.handle if context is None else kv.handle.for_context(context)


def _associated_data(key: Key, version: int, aad: bytes) -> bytes:
    """What the body's AEAD authenticates: cryptd's binding of key, version and type around the
    request's aad; for HPKE keys the aad alone (RFC 9180 Seal's aad, so a body made by any HPKE
    library decrypts; another key's or version's private key cannot open it anyway)."""
    if key.type.hpke:
        return aad
    return token.associated_data(key.name, version, key.type.type_id, aad)


def _seal(
    key: Key, version: int | None, plaintext: bytes, aad: bytes, context: bytes | None
) -> Result:
    kv = key.version(version, encrypting=True)
    ad = _associated_data(key, kv.version, aad)
    body = _handle(kv, context).encrypt(plaintext, ad)
    return {
        "ciphertext": token.encode(kv.version, key.type.type_id, body),
        "key_version": kv.version,
    }


def _token_version(key: Key, text: str, key_version: int | None) -> tuple[KeyVersion, bytes]:
    """The version a token (or MAC) names, checked against the one the request names."""
    version, type_id, body = token.decode(text)
    if key_version is not None and key_version != version:
        raise InvalidRequest("key_version does not match the version the token names")
    kv = key.version(version)
    if type_id != key.type.type_id:
        raise DecryptionFailed
    return kv, body


def _open(
    key: Key, ciphertext: str, aad: bytes, key_version: int | None, context: bytes | None
) -> tuple[bytes, int]:
    kv, body = _token_version(key, ciphertext, key_version)
    ad = _associated_data(key, kv.version, aad)
    return _handle(kv, context).decrypt(body, ad), kv.version


def encrypt(keyring: Keyring, key: Key, item: EncryptItem) -> Result:
    return _seal(key, item.key_version, item.plaintext, item.aad, item.context)


def decrypt(keyring: Keyring, key: Key, item: DecryptItem) -> Result:
    if item.format is None:
        plaintext, version = _open(key, item.ciphertext, item.aad, item.key_version, item.context)
        return {"plaintext": b64(plaintext), "key_version": version}
    if item.context is not None:
        raise InvalidRequest("'context' does not apply to external ciphertext formats")
    if item.format not in key.type.external_formats:
        allowed = ", ".join(sorted(key.type.external_formats)) or "none"
        raise InvalidRequest(
            f"format {item.format!r} not supported by {key.type.name} (allowed: {allowed})"
        )
    if item.aad:
        raise InvalidRequest("aad does not apply to external ciphertext formats")
    try:
        raw = b64codec.decode(item.ciphertext)
    except ValueError:
        raise InvalidRequest("ciphertext is not valid base64") from None
    kv = key.version(item.key_version)
    return {
        "plaintext": b64(kv.handle.decrypt_external(raw, item.format)),
        "key_version": kv.version,
    }


def _signing_version(
    key: Key, prehashed: bool, version: int | None, *, signing: bool
) -> KeyVersion:
    """The version to sign (at or above ``min_encryption_version``) or verify with. A digest's
    length is checked by the key handle: it depends on the hash the request chose."""
    if prehashed and key.type.sign_digest_size is None:
        raise InvalidRequest(
            f"key type {key.type.name} signs messages only; 'digest' is not accepted"
        )
    return key.version(version, encrypting=signing)


def _check_signing_context(key: Key, options: SignOptions) -> None:
    if options.context is None and options.message_type is None:
        return
    if not key.type.signing_context:
        if options.context is not None:
            raise InvalidRequest(
                "'context' applies to ML-DSA and composite ML-DSA keys (FIPS 204 context) and to "
                "derived keys; "
                f"key type {key.type.name} takes neither"
            )
        raise InvalidRequest(
            f"'message_type' applies to ML-DSA and composite ML-DSA keys, not {key.type.name}"
        )


def sign(keyring: Keyring, key: Key, item: SignItem) -> Result:
    _check_signing_context(key, item.options)
    kv = _signing_version(key, item.prehashed, item.key_version, signing=True)
    signature = kv.handle.sign(item.data, prehashed=item.prehashed, options=item.options)
    return {"signature": b64(signature), "key_version": kv.version}


def verify(keyring: Keyring, key: Key, item: VerifyItem | MacVerifyItem) -> Result:
    is_mac_key = key.type.supports("hmac")
    if isinstance(item, MacVerifyItem):
        if not is_mac_key:
            raise InvalidRequest(
                f"'mac' applies to HMAC keys; key type {key.type.name} verifies a 'signature'"
            )
        return {"valid": _verify_mac(key, item)}
    if is_mac_key:
        raise InvalidRequest(
            f"key type {key.type.name} verifies a 'mac' (with 'message'), not a 'signature'"
        )
    _check_signing_context(key, item.options)
    kv = _signing_version(key, item.prehashed, item.key_version, signing=False)
    valid = kv.handle.verify(
        item.signature, item.data, prehashed=item.prehashed, options=item.options
    )
    return {"valid": valid}


def hmac(keyring: Keyring, key: Key, item: HmacItem) -> Result:
    kv = key.version(item.key_version, encrypting=True)
    tag = _handle(kv, item.context).mac(item.data)
    return {"mac": token.encode_mac(kv.version, tag), "key_version": kv.version}


def _verify_mac(key: Key, item: MacVerifyItem) -> bool:
    version, tag = token.decode_mac(item.mac)
    if item.key_version is not None and item.key_version != version:
        raise InvalidRequest("key_version does not match the version the mac names")
    handle = _handle(key.version(version), item.context)
    return tag is not None and handle.verify_mac(tag, item.data)


def rewrap(keyring: Keyring, key: Key, item: RewrapItem) -> Result:
    target = key if item.to_key is None else keyring.key(item.to_key)
    if not target.type.supports("encrypt"):
        raise InvalidRequest(f"key type {target.type.name} does not support encrypt")
    # A key rewrapped under itself writes new data under it too: decrypt_only refuses that.
    target.check_use("rewrap to it" if target is not key else "rewrap under itself")
    if item.context is not None and not (key.derived or target.derived):
        raise InvalidRequest("'context' applies to derived keys only; neither key is derived")
    source_context = item.context if key.derived else None
    plaintext, _ = _open(key, item.ciphertext, item.aad, None, source_context)
    return _seal(target, None, plaintext, item.aad, item.context if target.derived else None)


def datakey(keyring: Keyring, key: Key, item: DatakeyItem) -> Result:
    if item.bits not in (128, 256):
        raise InvalidRequest("bits must be 128 or 256")
    dek = os.urandom(item.bits // 8)
    sealed = _seal(key, None, dek, item.aad, item.context)
    if not item.plaintext:
        return sealed
    return {"plaintext": b64(dek), **sealed}


def encapsulate(keyring: Keyring, key: Key, item: EncapsulateItem) -> Result:
    kv = key.version(None, encrypting=True)
    ciphertext, secret = kv.handle.encapsulate()
    return {"ciphertext": b64(ciphertext), "shared_secret": b64(secret), "key_version": kv.version}


def decapsulate(keyring: Keyring, key: Key, item: DecapsulateItem) -> Result:
    kv = key.version(item.key_version)
    return {"shared_secret": b64(kv.handle.decapsulate(item.ciphertext)), "key_version": kv.version}


OPERATIONS: dict[OpName, Callable[[Keyring, Key, Any], Result]] = {
    "encrypt": encrypt,
    "decrypt": decrypt,
    "sign": sign,
    "verify": verify,
    "rewrap": rewrap,
    "datakey": datakey,
    "hmac": hmac,
    "encapsulate": encapsulate,
    "decapsulate": decapsulate,
}


def translate(exc: Exception) -> CryptdError:
    """Map a lower layer's error to the client-facing one (never echoing internals)."""
    if isinstance(exc, CryptdError):
        return exc
    if isinstance(exc, InvalidCiphertext):
        return DecryptionFailed()
    if isinstance(exc, InvalidOptions | UnsupportedOperation):
        return InvalidRequest(str(exc))
    # Unexpected: log the type and where, not the message (it could hold data).
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb else "?"
    log.error(
        "unexpected error in crypto operation",
        extra={"error_type": type(exc).__name__, "where": where},
    )
    return Internal()


def error_entry(exc: CryptdError) -> Result:
    return {"error": {"code": exc.code, "message": exc.message}}


Outcome = Result | CryptdError


def run_batch(
    keyring: Keyring,
    op: OpName,
    name: str,
    items: Sequence[Item],
    observer: Observer | None = None,
) -> list[Outcome]:
    """Run ``items`` through the single-item function; a failing item yields its error.

    Key-level problems (unknown key, unsupported operation) raise instead: they concern the
    whole request, not one item.
    """
    key = keyring.key(name)
    check_operation(key, op)
    return run_items(keyring, key, op, items, observer)


def run_items(
    keyring: Keyring,
    key: Key,
    op: OpName,
    items: Sequence[Item],
    observer: Observer | None = None,
) -> list[Outcome]:
    """:func:`run_batch` on a key already looked up and checked for ``op``."""
    function = OPERATIONS[op]
    results: list[Outcome] = []
    failures = 0
    started = time.perf_counter()
    for item in items:
        try:
            results.append(function(keyring, key, item))
        except Exception as exc:
            failures += 1
            results.append(translate(exc))
    if observer is not None:
        outcome = "ok" if failures == 0 else ("error" if failures == len(items) else "partial")
        observer(op, key.type.name, time.perf_counter() - started, outcome, len(items))
    return results
