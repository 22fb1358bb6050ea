"""ML-KEM (FIPS 203) and X-Wing keys: HPKE encryption (RFC 9180) and raw encapsulation
(FIPS 203 ML-KEM; X-Wing's own, service/crypto/xwing.py).

``encrypt``/``decrypt`` are HPKE base mode, single-shot, KDF HKDF-SHA256 (0x0001), AEAD
AES-256-GCM (0x0002), empty ``info``, the request's ``aad`` as the HPKE aad; the token body is
``enc || ciphertext``. KEM ids: ML-KEM-768 0x0041, ML-KEM-1024 0x0042 (draft-ietf-hpke-pq),
X-Wing 0x647a (draft-connolly-cfrg-xwing-kem: ML-KEM-768 + X25519 with the SHA3-256
combiner; pyca/cryptography's ``KEM.MLKEM768_X25519``, whose ``enc`` is ct_M || ct_X, 1,120
bytes). docs/FORMAT.md gives the ids and a test vector.

pyca/cryptography 50 exposes HPKE as ``hpke.Suite.encrypt/decrypt(plaintext, key, info)``,
without the aad parameter RFC 9180 single-shot ``Seal`` has; the same Rust functions take an
aad as ``_encrypt_with_aad``/``_decrypt_with_aad`` (what ``Suite`` calls). Using them keeps
every byte of HPKE inside pyca/OpenSSL; writing the key schedule here would not.
tests/test_crypto_pq.py pins both against the public ``Suite`` (empty aad) and against
independent HPKE implementations.

Stored material is the seed: 64 bytes d || z for ML-KEM (FIPS 203 Algorithm 16), 32 bytes for
X-Wing, expanded as the X-Wing draft says (SHAKE256(seed, 96): the ML-KEM-768 seed, then the
X25519 private key; service/crypto/xwing.py).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.bindings._rust import openssl as _rust_openssl
from cryptography.hazmat.primitives import hpke
from cryptography.hazmat.primitives.asymmetric import mlkem

from service.crypto import xwing
from service.crypto.base import (
    InvalidCiphertext,
    InvalidKeyMaterial,
    InvalidOptions,
    KeyHandle,
    KeyType,
)
from service.crypto.pkcs8 import import_seed, public_pem

MLKEM_SEED_SIZE = 64
XWING_SEED_SIZE = 32
_seal = _rust_openssl.hpke._encrypt_with_aad
_open = _rust_openssl.hpke._decrypt_with_aad


_HpkePrivate = mlkem.MLKEM768PrivateKey | mlkem.MLKEM1024PrivateKey | hpke.MLKEM768X25519PrivateKey
_HpkePublic = mlkem.MLKEM768PublicKey | mlkem.MLKEM1024PublicKey | hpke.MLKEM768X25519PublicKey


class _KemPrivate(Protocol):
    def decapsulate(self, ciphertext: bytes) -> bytes: ...


class _KemPublic(Protocol):
    def encapsulate(self) -> tuple[bytes, bytes]: ...


class HpkeKey(KeyHandle):
    """A KEM key version: HPKE for encrypt/decrypt; the KEM itself for encapsulate and
    decapsulate."""

    __slots__ = (
        "_ciphertext_size",
        "_enc_size",
        "_kem_private",
        "_kem_public",
        "_pem",
        "_private",
        "_public",
        "_raw",
        "_suite",
        "type_name",
    )

    def __init__(
        self,
        type_name: str,
        kem: hpke.KEM,
        private: _HpkePrivate,
        public: _HpkePublic,
        raw_public: bytes,
        pem: str | None,
        kem_private: _KemPrivate,
        kem_public: _KemPublic,
        ciphertext_size: int,
    ) -> None:
        self.type_name = type_name  # type: ignore[misc]  # one class serves the three types
        self._suite = hpke.Suite(kem, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
        self._enc_size = kem.enc_length()
        self._private = private
        self._public = public
        self._raw = raw_public
        self._pem = pem
        self._kem_private = kem_private
        self._kem_public = kem_public
        self._ciphertext_size = ciphertext_size

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        return bytes(_seal(self._suite, plaintext, self._public, b"", associated_data))

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        # enc and the 16-byte tag at least; shorter is refused before any KEM work.
        if len(body) < self._enc_size + 16:
            raise InvalidCiphertext
        try:
            return bytes(_open(self._suite, body, self._private, b"", associated_data))
        except (InvalidTag, ValueError):
            raise InvalidCiphertext from None

    def encapsulate(self) -> tuple[bytes, bytes]:
        """(ciphertext, shared secret)."""
        secret, ciphertext = self._kem_public.encapsulate()  # pyca's order: (secret, ct)
        return bytes(ciphertext), bytes(secret)

    def decapsulate(self, ciphertext: bytes) -> bytes:
        if len(ciphertext) != self._ciphertext_size:
            raise InvalidOptions(
                f"{self.type_name} ciphertext must be {self._ciphertext_size} bytes"
            )
        return bytes(self._kem_private.decapsulate(ciphertext))

    def public_key_pem(self) -> str | None:
        return self._pem

    def public_key_raw(self) -> str:
        """The encapsulation key as HPKE's SerializePublicKey gives it, hex (X-Wing: pk_M ||
        pk_X, 1,216 bytes): what HPKE libraries take."""
        return self._raw.hex()


# ``cls``: pyca's abstract MLKEM768PrivateKey or MLKEM1024PrivateKey (no common base).
def _mlkem_type(level: int, type_id: int, cls: Any) -> KeyType:
    name = f"ml-kem-{level}"
    kem = hpke.KEM.MLKEM768 if level == 768 else hpke.KEM.MLKEM1024
    ciphertext_size = kem.enc_length()

    def load(material: bytes) -> KeyHandle:
        if len(material) != MLKEM_SEED_SIZE:
            raise InvalidKeyMaterial(f"{name} material must be a 64-byte seed")
        private = cls.from_seed_bytes(material)
        public = private.public_key()
        return HpkeKey(
            name,
            kem,
            private,
            public,
            public.public_bytes_raw(),
            public_pem(public),
            private,
            public,
            ciphertext_size,
        )

    def import_key(data: bytes) -> bytes:
        return import_seed(data, cls, name, MLKEM_SEED_SIZE)

    return KeyType(
        name=name,
        type_id=type_id,
        operations=frozenset({"encrypt", "decrypt", "encapsulate", "decapsulate"}),
        asymmetric=True,
        generate=lambda: os.urandom(MLKEM_SEED_SIZE),
        load=load,
        import_key=import_key,
        hpke=True,
    )


def _xwing_load(material: bytes) -> KeyHandle:
    if len(material) != XWING_SEED_SIZE:
        raise InvalidKeyMaterial("x25519-ml-kem-768 material must be a 32-byte seed")
    mlkem_private, x25519_private = xwing.expand(material)
    kem = xwing.XWing(mlkem_private, x25519_private)
    mlkem_public = mlkem_private.public_key()
    x25519_public = x25519_private.public_key()
    private = hpke.MLKEM768X25519PrivateKey(mlkem_private, x25519_private)
    public = hpke.MLKEM768X25519PublicKey(mlkem_public, x25519_public)
    raw = mlkem_public.public_bytes_raw() + x25519_public.public_bytes_raw()
    # No SPKI: pyca serializes no X-Wing public key (the draft's OID is not final);
    # ``public_key_raw`` is the key HPKE takes.
    return HpkeKey(
        "x25519-ml-kem-768",
        hpke.KEM.MLKEM768_X25519,
        private,
        public,
        raw,
        None,
        kem,
        kem,
        xwing.CIPHERTEXT_SIZE,
    )


def _xwing_import(data: bytes) -> bytes:
    if len(data) != XWING_SEED_SIZE:
        raise InvalidKeyMaterial("x25519-ml-kem-768 imports a 32-byte seed")
    return bytes(data)


ML_KEM_768 = _mlkem_type(768, 17, mlkem.MLKEM768PrivateKey)
ML_KEM_1024 = _mlkem_type(1024, 18, mlkem.MLKEM1024PrivateKey)
X25519_ML_KEM_768 = KeyType(
    name="x25519-ml-kem-768",
    type_id=19,
    operations=frozenset({"encrypt", "decrypt", "encapsulate", "decapsulate"}),
    asymmetric=True,
    generate=lambda: os.urandom(XWING_SEED_SIZE),
    load=_xwing_load,
    import_key=_xwing_import,
    hpke=True,
)
