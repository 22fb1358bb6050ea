"""Key material brought in wrapped, as Vault / OpenBao Transit (BYOK) and AWS KMS
(``RSA_AES_KEY_WRAP_SHA_256``) take it:

    wrapped = RSA-OAEP(wrapping public key, SHA-256, MGF1-SHA-256, no label; ephemeral AES-256 key)
              || AES key wrap with padding (RFC 5649; ephemeral key; material)

The RSA block is exactly the wrapping key's modulus size (512 bytes for RSA-4096); the rest is
the RFC 5649 output (a multiple of 8 bytes, at least 16). The material is what the key type
imports: raw bytes for secret keys, PKCS#8 DER for private keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Final

from cryptography.hazmat.primitives import keywrap
from cryptography.hazmat.primitives.asymmetric import rsa

from service.crypto.base import CryptoError, InvalidCiphertext
from service.crypto.rsa import OAEP

EPHEMERAL_KEY_SIZE: Final = 32
WRAPPING_KEY_TYPE: Final = "rsa-4096"
WRAPPING_KEY_BITS: Final = 4096
_KWP_MIN: Final = 16


class WrappedKeyError(CryptoError):
    """The wrapped key cannot be unwrapped; the message says which layer failed (safe to show:
    it holds no key bytes)."""


def wrap(public: rsa.RSAPublicKey, material: bytes) -> bytes:
    """What an outside client sends (used by ``cryptd call import``)."""
    ephemeral = os.urandom(EPHEMERAL_KEY_SIZE)
    return public.encrypt(ephemeral, OAEP) + keywrap.aes_key_wrap_with_padding(ephemeral, material)


def unwrap(
    oaep_decrypt: Callable[[bytes], bytes], wrapped: bytes, *, bits: int = WRAPPING_KEY_BITS
) -> bytes:
    """The material inside ``wrapped``; WrappedKeyError if it is damaged, truncated, re-ordered
    or made for another wrapping key. ``oaep_decrypt`` is the wrapping key's RSA-OAEP-SHA256
    decryption (a key handle's ``decrypt_external``), raising InvalidCiphertext on failure."""
    size = bits // 8
    if len(wrapped) < size + _KWP_MIN:
        raise WrappedKeyError(
            f"wrapped key too short: an RSA-OAEP block of {size} bytes, then at least "
            f"{_KWP_MIN} bytes of AES key wrap"
        )
    if (len(wrapped) - size) % 8:
        raise WrappedKeyError(
            f"wrapped key malformed: the AES key wrap after the {size}-byte RSA-OAEP block "
            "must be a multiple of 8 bytes"
        )
    try:
        ephemeral = oaep_decrypt(wrapped[:size])
    except InvalidCiphertext:
        raise WrappedKeyError(
            "the ephemeral key does not decrypt under this wrapping key "
            "(RSA-OAEP with SHA-256; another wrapping key, or a damaged first block)"
        ) from None
    if len(ephemeral) != EPHEMERAL_KEY_SIZE:
        raise WrappedKeyError("the ephemeral key must be a 256-bit AES key")
    try:
        return keywrap.aes_key_unwrap_with_padding(ephemeral, wrapped[size:])
    except keywrap.InvalidUnwrap:
        raise WrappedKeyError(
            "the key material does not unwrap (AES key wrap with padding, RFC 5649: "
            "integrity check failed)"
        ) from None
