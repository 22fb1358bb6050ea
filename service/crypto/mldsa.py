"""ML-DSA (FIPS 204) signatures: ML-DSA-44, ML-DSA-65 and ML-DSA-87, from pyca/cryptography
(OpenSSL). The stored material is the 32-byte seed xi (FIPS 204 Algorithm 6), the form FIPS 204
and the PKCS#8 "seed" choice keep; the expanded key is rebuilt from it when a version loads.

A request signs the message itself (``message_type`` "raw", the default, with an optional
``context`` of 0-255 bytes: pure ML-DSA, FIPS 204 Algorithm 2) or a 64-byte mu the caller
computed (``external_mu``, FIPS 204 section 6.2: mu = SHAKE256(SHAKE256(pk, 64) || 0 ||
len(ctx) || ctx || M, 64)), so a large file never has to be sent. mu already binds a context:
``context`` with ``external_mu`` is refused. Signing is hedged (OpenSSL's default: fresh
randomness mixed with the key), so two signatures of one message differ and both verify.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import mldsa

from service.crypto.base import InvalidKeyMaterial, InvalidOptions, KeyHandle, KeyType, SignOptions
from service.crypto.pkcs8 import import_seed, public_pem

SEED_SIZE = 32
MU_SIZE = 64
MAX_CONTEXT = 255
MESSAGE_TYPES = ("raw", "external_mu")


class _Private(Protocol):
    def sign(self, data: bytes, context: bytes | None = None) -> bytes: ...
    def sign_mu(self, mu: bytes) -> bytes: ...


class _Public(Protocol):
    def verify(self, signature: bytes, data: bytes, context: bytes | None = None) -> None: ...
    def verify_mu(self, signature: bytes, mu: bytes) -> None: ...


def _external_mu(options: SignOptions) -> bool:
    """Whether the request sends mu; refuses options ML-DSA does not take, and bad values."""
    options.refuse("algorithm", "encoding", "signer_id", "hash_algorithm")
    if options.context is not None and len(options.context) > MAX_CONTEXT:
        raise InvalidOptions("context must be at most 255 bytes")
    if options.message_type in (None, "raw"):
        return False
    if options.message_type != "external_mu":
        raise InvalidOptions("message_type must be 'raw' or 'external_mu'")
    if options.context is not None:
        raise InvalidOptions("'context' does not apply to external_mu: mu already binds it")
    return True


def _check_mu(data: bytes) -> None:
    if len(data) != MU_SIZE:
        raise InvalidOptions("external_mu: 'message' must be the 64-byte mu")


class MlDsaKey(KeyHandle):
    __slots__ = ("_private", "_public", "_public_key", "type_name")

    def __init__(self, type_name: str, private: Any) -> None:
        self.type_name = type_name  # type: ignore[misc]  # one class serves the three sets
        self._private: _Private = private
        self._public_key = private.public_key()
        self._public: _Public = self._public_key

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        if _external_mu(options):
            _check_mu(data)
            return self._private.sign_mu(data)
        return self._private.sign(data, options.context)

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        external = _external_mu(options)
        if external:
            _check_mu(data)
        try:
            if external:
                self._public.verify_mu(signature, data)
            else:
                self._public.verify(signature, data, options.context)
        except (InvalidSignature, ValueError):
            return False
        return True

    def public_key_pem(self) -> str:
        return public_pem(self._public_key)


# ``cls``: one of pyca's three abstract MLDSA<n>PrivateKey classes (no common base to name).
def _mldsa_type(level: int, type_id: int, cls: Any) -> KeyType:
    name = f"ml-dsa-{level}"
    from_seed: Callable[[bytes], Any] = cls.from_seed_bytes

    def load(material: bytes) -> KeyHandle:
        if len(material) != SEED_SIZE:
            raise InvalidKeyMaterial(f"{name} material must be a 32-byte seed")
        return MlDsaKey(name, from_seed(material))

    def import_key(data: bytes) -> bytes:
        return import_seed(data, cls, name, SEED_SIZE)

    return KeyType(
        name=name,
        type_id=type_id,
        operations=frozenset({"sign", "verify"}),
        asymmetric=True,
        generate=lambda: cls.generate().private_bytes_raw(),
        load=load,
        import_key=import_key,
        signing_context=True,
    )


ML_DSA_44 = _mldsa_type(44, 14, mldsa.MLDSA44PrivateKey)
ML_DSA_65 = _mldsa_type(65, 15, mldsa.MLDSA65PrivateKey)
ML_DSA_87 = _mldsa_type(87, 16, mldsa.MLDSA87PrivateKey)
