"""Ed25519 (RFC 8032). Signs messages only: a precomputed digest is refused.

Signing a message of up to ``SODIUM_MAX_MESSAGE`` bytes runs in libsodium (PyNaCl), about 1.7x
the speed of OpenSSL (pyca/cryptography) on a short message; a longer one runs in OpenSSL,
whose SHA-512 is the faster from about 10 KiB on (twice libsodium's at 1 MiB). Ed25519
signatures are deterministic, so both give the same bytes for the same seed and message.
Both calls release the GIL.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519
from nacl.bindings import crypto_sign, crypto_sign_seed_keypair

from service.crypto.base import InvalidKeyMaterial, InvalidOptions, KeyHandle, KeyType, SignOptions
from service.crypto.pkcs8 import load_untrusted, public_pem

_SIZE = 32
_SIGNATURE_SIZE = 64
# Above this many bytes OpenSSL signs (see the module docstring; crossover measured at 9-10 KiB).
SODIUM_MAX_MESSAGE = 8 * 1024


class Ed25519Key(KeyHandle):
    type_name = "ed25519"
    # _sodium_secret is libsodium's secret key, seed || public key: the seed is held by it and
    # by OpenSSL's key object, and by nothing else here.
    __slots__ = ("_private", "_public", "_sodium_secret")

    def __init__(self, seed: bytes) -> None:
        self._private = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
        self._public = self._private.public_key()
        self._sodium_secret = crypto_sign_seed_keypair(seed)[1]

    @staticmethod
    def _check(prehashed: bool, options: SignOptions) -> None:
        options.refuse("algorithm", "encoding", "signer_id", "hash_algorithm")
        if prehashed:
            raise InvalidOptions("ed25519 signs messages only; 'digest' is not accepted")

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        self._check(prehashed, options)
        if len(data) <= SODIUM_MAX_MESSAGE:
            # crypto_sign returns signature || message; PyNaCl has no detached signing call.
            return crypto_sign(data, self._sodium_secret)[:_SIGNATURE_SIZE]
        return self._private.sign(data)

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        self._check(prehashed, options)
        # OpenSSL verifies, so what verify accepts stays as it was: libsodium's crypto_sign_open
        # adds checks OpenSSL does not make (small-order points, rules that changed between
        # libsodium releases) and takes signature || message, a copy of the message.
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
    return Ed25519Key(material)


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
