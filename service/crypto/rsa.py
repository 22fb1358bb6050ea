"""RSA keys: hybrid encryption (RSA-OAEP-SHA256 wraps an AES-256-GCM data key) and
RSA-PSS (MGF1 with the same hash, salt = digest length) or PKCS#1 v1.5 signatures with SHA-256
by default, SHA-384 or SHA-512 on request (``hash_algorithm``)."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed

from service.crypto import digests, hybrid
from service.crypto.aead import AesGcm
from service.crypto.base import (
    InvalidCiphertext,
    InvalidKeyMaterial,
    InvalidOptions,
    KeyHandle,
    KeyType,
    SignOptions,
)
from service.crypto.pkcs8 import load_trusted, load_untrusted, private_der, public_pem

DEK_SIZE = 32
OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
_PKCS1 = padding.PKCS1v15()


class _Scheme:
    """The padding objects and hash for one hash name, built once."""

    __slots__ = ("message", "prehashed", "pss")

    def __init__(self, algorithm: hashes.HashAlgorithm) -> None:
        self.pss = padding.PSS(mgf=padding.MGF1(algorithm), salt_length=padding.PSS.DIGEST_LENGTH)
        self.message = algorithm
        self.prehashed = Prehashed(algorithm)


_SCHEMES = {name: _Scheme(algorithm) for name, algorithm in digests.HASHES.items()}


def _scheme(
    data: bytes, prehashed: bool, options: SignOptions
) -> tuple[padding.AsymmetricPadding, hashes.HashAlgorithm | Prehashed]:
    options.refuse("encoding", "signer_id")
    name = digests.choose(options.hash_algorithm, digests.SHA2_256)
    scheme = _SCHEMES[name]
    if options.algorithm in (None, "pss"):
        pad: padding.AsymmetricPadding = scheme.pss
    elif options.algorithm == "pkcs1v15":
        pad = _PKCS1
    else:
        raise InvalidOptions("algorithm must be 'pss' or 'pkcs1v15'")
    if prehashed:
        digests.check_digest(data, name)
        return pad, scheme.prehashed
    return pad, scheme.message


class RsaKey(KeyHandle):
    __slots__ = ("_private", "_public", "type_name")

    def __init__(self, type_name: str, private: rsa.RSAPrivateKey) -> None:
        self.type_name = type_name  # type: ignore[misc]  # one class serves every RSA size
        self._private = private
        self._public = private.public_key()

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        return hybrid.seal(
            plaintext,
            associated_data,
            dek_size=DEK_SIZE,
            wrap=lambda dek: self._public.encrypt(dek, OAEP),
            aead=AesGcm,
        )

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        return hybrid.open_(
            body, associated_data, dek_size=DEK_SIZE, unwrap=self._oaep_decrypt, aead=AesGcm
        )

    def decrypt_external(self, ciphertext: bytes, fmt: str) -> bytes:
        if fmt != "rsa-oaep-sha256":
            raise InvalidOptions("format must be 'rsa-oaep-sha256' for RSA keys")
        return self._oaep_decrypt(ciphertext)

    def _oaep_decrypt(self, ciphertext: bytes) -> bytes:
        try:
            return self._private.decrypt(ciphertext, OAEP)
        except ValueError:
            raise InvalidCiphertext from None

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        pad, algorithm = _scheme(data, prehashed, options)
        return self._private.sign(data, pad, algorithm)

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        pad, algorithm = _scheme(data, prehashed, options)
        try:
            self._public.verify(signature, data, pad, algorithm)
        except (InvalidSignature, ValueError):
            return False
        return True

    def public_key_pem(self) -> str:
        return public_pem(self._public)


def _rsa_type(bits: int, type_id: int) -> KeyType:
    name = f"rsa-{bits}"

    def generate() -> bytes:
        return private_der(rsa.generate_private_key(public_exponent=65537, key_size=bits))

    def load(material: bytes) -> KeyHandle:
        key = load_trusted(material)
        if not isinstance(key, rsa.RSAPrivateKey) or key.key_size != bits:
            raise InvalidKeyMaterial(f"material is not an {name} private key")
        return RsaKey(name, key)

    def import_key(data: bytes) -> bytes:
        key = load_untrusted(data)
        if not isinstance(key, rsa.RSAPrivateKey) or key.key_size != bits:
            raise InvalidKeyMaterial(f"not an {name} private key")
        if key.private_numbers().public_numbers.e != 65537:
            raise InvalidKeyMaterial("RSA public exponent must be 65537")
        return private_der(key)

    return KeyType(
        name=name,
        type_id=type_id,
        operations=frozenset({"encrypt", "decrypt", "sign", "verify"}),
        asymmetric=True,
        generate=generate,
        load=load,
        import_key=import_key,
        external_formats=frozenset({"rsa-oaep-sha256"}),
        sign_digest_size=32,
    )


RSA_2048 = _rsa_type(2048, 3)
RSA_3072 = _rsa_type(3072, 4)
RSA_4096 = _rsa_type(4096, 5)
