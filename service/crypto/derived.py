"""Derived keys: one key version, a separate key for every ``context`` (a tenant, a user).

Each context's key is HKDF (RFC 5869) of the version's material, with no salt and with ``info``
binding the key's name, version and type and the context (docs/FORMAT.md, section 7)::

    info = "cryptd/derive/1" || purpose (u8) || type id (u8) || len(name) (u8) || version (u32)
           || name || context

Purpose 1 derives the context's key; purpose 2 the nonce key of a convergent key. HKDF runs over
SM3 for the SM types and over SHA-256 otherwise.

Convergent keys encrypt deterministically: the 96-bit nonce is HMAC(nonce key, u32 len(ad) ||
ad || plaintext) truncated, so equal (context, associated data, plaintext) give equal tokens and
anything else gives a different nonce (a synthetic-IV construction: a nonce is reused only with
the very same inputs, where GCM then repeats the same output and reveals nothing more).
Decryption recomputes the nonce and refuses a token whose nonce is not the one its plaintext
gives, so every plaintext has exactly one token.
"""

from __future__ import annotations

import functools
import hmac as constant_time
import struct
from collections.abc import Callable
from typing import Final, NoReturn

from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from service.crypto.aead import NONCE_SIZE, Aead
from service.crypto.base import InvalidCiphertext, InvalidOptions, KeyHandle

LABEL: Final = b"cryptd/derive/1"
PURPOSE_KEY: Final = 1
PURPOSE_NONCE: Final = 2
NONCE_KEY_SIZE: Final = 32
MAX_CONTEXT: Final = 1024  # bytes; a context names a tenant or a record, not a payload
CACHE_SIZE: Final = 1024  # derived handles kept per key version (HKDF + cipher setup ~10 us)
_LENGTHS = struct.Struct(">BBI")


def binding(type_id: int, name: str, version: int) -> bytes:
    """The key's identity in ``info``: every field before the context has a fixed size or a
    length, so no two (type, name, version, context) give the same ``info``."""
    encoded = name.encode()
    return _LENGTHS.pack(type_id, len(encoded), version) + encoded


def hkdf(
    algorithm: hashes.HashAlgorithm, ikm: bytes, *, salt: bytes | None, info: bytes, length: int
) -> bytes:
    """HKDF-Extract then HKDF-Expand (RFC 5869), pyca/cryptography's implementation."""
    return HKDF(algorithm=algorithm, length=length, salt=salt, info=info).derive(ikm)


def derive(
    algorithm: hashes.HashAlgorithm,
    material: bytes,
    purpose: int,
    key_binding: bytes,
    context: bytes,
    length: int,
) -> bytes:
    info = LABEL + bytes([purpose]) + key_binding + context
    return hkdf(algorithm, material, salt=None, info=info, length=length)


def check_context(context: bytes) -> None:
    if not context:
        raise InvalidOptions("'context' must not be empty")
    if len(context) > MAX_CONTEXT:
        raise InvalidOptions(f"'context' must be at most {MAX_CONTEXT} bytes")


class DerivedKey(KeyHandle):
    """A derived key version: every operation goes through :meth:`for_context`."""

    __slots__ = ("_derive", "type_name")

    def __init__(self, type_name: str, make: Callable[[bytes], KeyHandle]) -> None:
        self.type_name = type_name  # type: ignore[misc]
        self._derive = functools.lru_cache(maxsize=CACHE_SIZE)(make)

    def for_context(self, context: bytes) -> KeyHandle:
        check_context(context)
        return self._derive(bytes(context))

    def _needs_context(self) -> NoReturn:
        raise InvalidOptions("this key is derived: every operation needs a 'context'")

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        self._needs_context()

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        self._needs_context()

    def mac(self, message: bytes) -> bytes:
        self._needs_context()

    def verify_mac(self, tag: bytes, message: bytes) -> bool:
        self._needs_context()


class ConvergentAeadKey(KeyHandle):
    """One context's key of a convergent key: deterministic AEAD (see the module text)."""

    __slots__ = ("_aead", "_algorithm", "_nonce_key", "type_name")

    def __init__(
        self, type_name: str, aead: Aead, nonce_key: bytes, algorithm: hashes.HashAlgorithm
    ) -> None:
        self.type_name = type_name  # type: ignore[misc]
        self._aead = aead
        self._nonce_key = nonce_key
        self._algorithm = algorithm

    def nonce(self, plaintext: bytes, associated_data: bytes) -> bytes:
        context = hmac.HMAC(self._nonce_key, self._algorithm)
        context.update(struct.pack(">I", len(associated_data)))
        context.update(associated_data)
        context.update(plaintext)
        return context.finalize()[:NONCE_SIZE]

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        nonce = self.nonce(plaintext, associated_data)
        return self._aead.seal_with_nonce(nonce, plaintext, associated_data)

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        plaintext = self._aead.open(body, associated_data)
        if not constant_time.compare_digest(
            self.nonce(plaintext, associated_data), body[:NONCE_SIZE]
        ):
            raise InvalidCiphertext
        return plaintext
