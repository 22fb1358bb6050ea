"""Secret-key types: AES-256-GCM and SM4-GCM. The material is the raw key; a derived key
encrypts with a key per context, deterministically when convergent (service.crypto.derived)."""

from __future__ import annotations

import os
from collections.abc import Callable

from cryptography.hazmat.primitives import hashes

from service.crypto import derived
from service.crypto.aead import Aead, AesGcm, Sm4Gcm
from service.crypto.base import InvalidKeyMaterial, KeyHandle, KeyType


class AeadKey(KeyHandle):
    __slots__ = ("_aead", "type_name")

    def __init__(self, type_name: str, aead: Aead) -> None:
        self.type_name = type_name  # type: ignore[misc]  # one class serves both AEAD types
        self._aead = aead

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        return self._aead.seal(plaintext, associated_data)

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        return self._aead.open(body, associated_data)


def _aead_type(
    name: str,
    type_id: int,
    size: int,
    factory: Callable[[bytes], Aead],
    kdf_hash: hashes.HashAlgorithm,
) -> KeyType:
    def load(material: bytes) -> KeyHandle:
        if len(material) != size:
            raise InvalidKeyMaterial(f"{name} key must be {size} bytes")
        return AeadKey(name, factory(material))

    def derive(material: bytes, binding: bytes, convergent: bool) -> KeyHandle:
        if len(material) != size:
            raise InvalidKeyMaterial(f"{name} key must be {size} bytes")

        def make(context: bytes) -> KeyHandle:
            key = derived.derive(kdf_hash, material, derived.PURPOSE_KEY, binding, context, size)
            if not convergent:
                return AeadKey(name, factory(key))
            nonce_key = derived.derive(
                kdf_hash,
                material,
                derived.PURPOSE_NONCE,
                binding,
                context,
                derived.NONCE_KEY_SIZE,
            )
            return derived.ConvergentAeadKey(name, factory(key), nonce_key, kdf_hash)

        return derived.DerivedKey(name, make)

    def import_key(data: bytes) -> bytes:
        if len(data) != size:
            raise InvalidKeyMaterial(f"{name} key must be {size} bytes")
        return bytes(data)

    return KeyType(
        name=name,
        type_id=type_id,
        operations=frozenset({"encrypt", "decrypt"}),
        asymmetric=False,
        generate=lambda: os.urandom(size),
        load=load,
        import_key=import_key,
        derive=derive,
        convergent=True,
    )


AES256_GCM = _aead_type("aes256-gcm", 1, 32, AesGcm, hashes.SHA256())
SM4_GCM = _aead_type("sm4-gcm", 2, 16, Sm4Gcm, hashes.SM3())
