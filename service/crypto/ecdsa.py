"""ECDSA on P-256, P-384 and P-521. Each curve signs with its matching SHA-2 hash by default
(SHA-256, SHA-384, SHA-512); ``hash_algorithm`` picks another. Signatures are DER by default,
fixed-length r||s with "raw"."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    Prehashed,
    decode_dss_signature,
    encode_dss_signature,
)

from service.crypto import digests
from service.crypto.base import InvalidKeyMaterial, KeyHandle, KeyType, SignOptions
from service.crypto.pkcs8 import load_trusted, load_untrusted, private_der, public_pem

# (message algorithm, digest algorithm) per hash name, built once.
_ALGORITHMS: dict[str, tuple[ec.ECDSA, ec.ECDSA]] = {
    name: (ec.ECDSA(algorithm), ec.ECDSA(Prehashed(algorithm)))
    for name, algorithm in digests.HASHES.items()
}


def der_to_raw(signature: bytes, size: int) -> bytes:
    r, s = decode_dss_signature(signature)
    return r.to_bytes(size, "big") + s.to_bytes(size, "big")


def raw_to_der(signature: bytes, size: int) -> bytes | None:
    if len(signature) != 2 * size:
        return None
    return encode_dss_signature(
        int.from_bytes(signature[:size], "big"), int.from_bytes(signature[size:], "big")
    )


class EcdsaKey(KeyHandle):
    """One class for every curve; ``type_name``, the scalar size and the default hash differ."""

    __slots__ = ("_default_hash", "_private", "_public", "_scalar", "type_name")

    def __init__(
        self,
        type_name: str,
        private: ec.EllipticCurvePrivateKey,
        *,
        scalar: int,
        default_hash: str,
    ) -> None:
        self.type_name = type_name  # type: ignore[misc]  # one class serves every curve
        self._private = private
        self._public = private.public_key()
        self._scalar = scalar
        self._default_hash = default_hash

    def _algorithm(self, data: bytes, prehashed: bool, options: SignOptions) -> ec.ECDSA:
        name = digests.choose(options.hash_algorithm, self._default_hash)
        if prehashed:
            digests.check_digest(data, name)
        message, digest = _ALGORITHMS[name]
        return digest if prehashed else message

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        raw = options.raw_encoding("algorithm", "signer_id")
        signature = self._private.sign(data, self._algorithm(data, prehashed, options))
        return der_to_raw(signature, self._scalar) if raw else signature

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        raw = options.raw_encoding("algorithm", "signer_id")
        algorithm = self._algorithm(data, prehashed, options)
        if raw:
            der = raw_to_der(signature, self._scalar)
            if der is None:
                return False
            signature = der
        try:
            self._public.verify(signature, data, algorithm)
        except (InvalidSignature, ValueError):
            return False
        return True

    def public_key_pem(self) -> str:
        return public_pem(self._public)


def _ecdsa_type(
    name: str, type_id: int, curve: type[ec.EllipticCurve], scalar: int, default_hash: str
) -> KeyType:
    def check(key: object) -> ec.EllipticCurvePrivateKey:
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, curve):
            raise InvalidKeyMaterial(f"not a {curve.name} private key for {name}")
        return key

    def load(material: bytes) -> KeyHandle:
        return EcdsaKey(
            name, check(load_trusted(material)), scalar=scalar, default_hash=default_hash
        )

    return KeyType(
        name=name,
        type_id=type_id,
        operations=frozenset({"sign", "verify"}),
        asymmetric=True,
        generate=lambda: private_der(ec.generate_private_key(curve())),
        load=load,
        import_key=lambda data: private_der(check(load_untrusted(data))),
        sign_digest_size=digests.HASHES[default_hash].digest_size,
    )


ECDSA_P256 = _ecdsa_type("ecdsa-p256", 6, ec.SECP256R1, 32, digests.SHA2_256)
ECDSA_P384 = _ecdsa_type("ecdsa-p384", 12, ec.SECP384R1, 48, digests.SHA2_384)
ECDSA_P521 = _ecdsa_type("ecdsa-p521", 13, ec.SECP521R1, 66, digests.SHA2_512)
