"""ECDSA on P-256 with SHA-256. Signatures are DER by default, fixed-length r||s with "raw"."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    Prehashed,
    decode_dss_signature,
    encode_dss_signature,
)

from service.crypto.base import InvalidKeyMaterial, InvalidOptions, KeyHandle, KeyType, SignOptions
from service.crypto.pkcs8 import load_trusted, load_untrusted, private_der, public_pem

_SCALAR = 32
_ALGORITHM = ec.ECDSA(hashes.SHA256())
_PREHASHED = ec.ECDSA(Prehashed(hashes.SHA256()))


def _raw_encoding(options: SignOptions) -> bool:
    options.refuse("algorithm", "signer_id")
    if options.encoding in (None, "der"):
        return False
    if options.encoding == "raw":
        return True
    raise InvalidOptions("encoding must be 'der' or 'raw'")


def der_to_raw(signature: bytes, size: int) -> bytes:
    r, s = decode_dss_signature(signature)
    return r.to_bytes(size, "big") + s.to_bytes(size, "big")


def raw_to_der(signature: bytes, size: int) -> bytes | None:
    if len(signature) != 2 * size:
        return None
    return encode_dss_signature(
        int.from_bytes(signature[:size], "big"), int.from_bytes(signature[size:], "big")
    )


class EcdsaP256Key(KeyHandle):
    type_name = "ecdsa-p256"
    __slots__ = ("_private", "_public")

    def __init__(self, private: ec.EllipticCurvePrivateKey) -> None:
        self._private = private
        self._public = private.public_key()

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        raw = _raw_encoding(options)
        signature = self._private.sign(data, _PREHASHED if prehashed else _ALGORITHM)
        return der_to_raw(signature, _SCALAR) if raw else signature

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        if _raw_encoding(options):
            der = raw_to_der(signature, _SCALAR)
            if der is None:
                return False
            signature = der
        try:
            self._public.verify(signature, data, _PREHASHED if prehashed else _ALGORITHM)
        except (InvalidSignature, ValueError):
            return False
        return True

    def public_key_pem(self) -> str:
        return public_pem(self._public)


def _check(key: object) -> ec.EllipticCurvePrivateKey:
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise InvalidKeyMaterial("not a P-256 private key")
    return key


ECDSA_P256 = KeyType(
    name="ecdsa-p256",
    type_id=6,
    operations=frozenset({"sign", "verify"}),
    asymmetric=True,
    generate=lambda: private_der(ec.generate_private_key(ec.SECP256R1())),
    load=lambda material: EcdsaP256Key(_check(load_trusted(material))),
    import_key=lambda data: private_der(_check(load_untrusted(data))),
    sign_digest_size=32,
)
