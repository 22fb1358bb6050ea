"""Ed25519 (RFC 8032). Signs messages only: a precomputed digest is refused."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from service.crypto.base import InvalidKeyMaterial, InvalidOptions, KeyHandle, KeyType, SignOptions
from service.crypto.pkcs8 import load_untrusted, public_pem

_SIZE = 32


class Ed25519Key(KeyHandle):
    type_name = "ed25519"
    __slots__ = ("_private", "_public")

    def __init__(self, private: ed25519.Ed25519PrivateKey) -> None:
        self._private = private
        self._public = private.public_key()

    @staticmethod
    def _check(prehashed: bool, options: SignOptions) -> None:
        options.refuse("algorithm", "encoding", "signer_id", "hash_algorithm")
        if prehashed:
            raise InvalidOptions("ed25519 signs messages only; 'digest' is not accepted")

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        self._check(prehashed, options)
        return self._private.sign(data)

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        self._check(prehashed, options)
        try:
            self._public.verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        return True

    def public_key_pem(self) -> str:
        return public_pem(self._public)


def _load(material: bytes) -> KeyHandle:
    if len(material) != _SIZE:
        raise InvalidKeyMaterial("ed25519 material must be a 32-byte seed")
    return Ed25519Key(ed25519.Ed25519PrivateKey.from_private_bytes(material))


def _import(data: bytes) -> bytes:
    key = load_untrusted(data)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise InvalidKeyMaterial("not an ed25519 private key")
    return key.private_bytes_raw()


ED25519 = KeyType(
    name="ed25519",
    type_id=7,
    operations=frozenset({"sign", "verify"}),
    asymmetric=True,
    generate=lambda: ed25519.Ed25519PrivateKey.generate().private_bytes_raw(),
    load=_load,
    import_key=_import,
)
