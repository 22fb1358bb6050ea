"""PKCS#8 helpers shared by the pyca-backed private-key types."""

from __future__ import annotations

from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import (
    PrivateKeyTypes,
    PublicKeyTypes,
)

from service.crypto.base import InvalidKeyMaterial


def private_der(key: PrivateKeyTypes) -> bytes:
    return key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_trusted(material: bytes) -> PrivateKeyTypes:
    """Parse PKCS#8 DER that the keyring already authenticated under the master key.

    RSA validation costs ~30 ms per key and proves nothing here: the material was validated
    when it was generated or imported, and GCM under the master key guarantees it is unchanged.
    """
    return serialization.load_der_private_key(
        material, password=None, unsafe_skip_rsa_key_validation=True
    )


def load_untrusted(data: bytes) -> PrivateKeyTypes:
    """Parse a PEM or DER private key from outside, with full validation."""
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise InvalidKeyMaterial("not a supported unencrypted private key") from None


def import_seed(data: bytes, cls: Any, name: str, size: int) -> bytes:
    """A post-quantum private key from outside as its ``size``-byte seed: the raw seed, or
    PKCS#8 (PEM or DER) of class ``cls`` holding it (the expanded form alone is refused)."""
    if len(data) == size:
        return bytes(data)
    key = load_untrusted(data)
    if not isinstance(key, cls):
        raise InvalidKeyMaterial(f"not an {name} private key")
    try:
        seed: bytes = key.private_bytes_raw()
    except (ValueError, UnsupportedAlgorithm):
        raise InvalidKeyMaterial(
            f"the {name} PKCS#8 key must hold its seed (the expanded form alone is refused)"
        ) from None
    if len(seed) != size:
        raise InvalidKeyMaterial(f"not an {name} seed")
    return seed


def public_pem(key: PublicKeyTypes) -> str:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")
