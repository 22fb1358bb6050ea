"""HMAC keys (RFC 2104): HMAC-SHA-256, HMAC-SHA-512 and HMAC-SM3 (GM/T 0042) through
pyca/cryptography. The material is the raw key; tags are compared in constant time."""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, hmac

from service.crypto import derived
from service.crypto.base import InvalidKeyMaterial, KeyHandle, KeyType

# Imported keys: at least 128 bits (a shorter key is the weakest part of the MAC), at most
# 1 KiB (HMAC hashes any key longer than a block, so more adds nothing).
MIN_IMPORT_SIZE = 16
MAX_IMPORT_SIZE = 1024


class HmacKey(KeyHandle):
    __slots__ = ("_algorithm", "_key", "type_name")

    def __init__(self, type_name: str, key: bytes, algorithm: hashes.HashAlgorithm) -> None:
        if not key:
            raise InvalidKeyMaterial("an HMAC key cannot be empty")
        self.type_name = type_name  # type: ignore[misc]  # one class serves every HMAC type
        self._key = key
        self._algorithm = algorithm

    def mac(self, message: bytes) -> bytes:
        context = hmac.HMAC(self._key, self._algorithm)
        context.update(message)
        return context.finalize()

    def verify_mac(self, tag: bytes, message: bytes) -> bool:
        context = hmac.HMAC(self._key, self._algorithm)
        context.update(message)
        try:
            context.verify(tag)  # constant-time comparison (OpenSSL CRYPTO_memcmp)
        except InvalidSignature:
            return False
        return True


def _hmac_type(
    name: str, type_id: int, algorithm: hashes.HashAlgorithm, kdf_hash: hashes.HashAlgorithm
) -> KeyType:
    size = algorithm.digest_size  # generated keys: as long as the hash output (RFC 2104 sec. 3)

    def derive(material: bytes, binding: bytes, convergent: bool) -> KeyHandle:
        if convergent:
            raise InvalidKeyMaterial(f"{name} keys cannot be convergent")

        def make(context: bytes) -> KeyHandle:
            key = derived.derive(kdf_hash, material, derived.PURPOSE_KEY, binding, context, size)
            return HmacKey(name, key, algorithm)

        return derived.DerivedKey(name, make)

    def import_key(data: bytes) -> bytes:
        if not MIN_IMPORT_SIZE <= len(data) <= MAX_IMPORT_SIZE:
            raise InvalidKeyMaterial(
                f"{name} key must be {MIN_IMPORT_SIZE} to {MAX_IMPORT_SIZE} bytes"
            )
        return bytes(data)

    return KeyType(
        name=name,
        type_id=type_id,
        operations=frozenset({"hmac", "verify"}),
        asymmetric=False,
        generate=lambda: os.urandom(size),
        load=lambda material: HmacKey(name, material, algorithm),
        import_key=import_key,
        derive=derive,
    )


HMAC_SHA256 = _hmac_type("hmac-sha256", 9, hashes.SHA256(), hashes.SHA256())
HMAC_SHA512 = _hmac_type("hmac-sha512", 10, hashes.SHA512(), hashes.SHA256())
HMAC_SM3 = _hmac_type("hmac-sm3", 11, hashes.SM3(), hashes.SM3())
