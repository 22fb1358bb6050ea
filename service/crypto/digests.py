"""The hash a signature uses: ``hash_algorithm`` on RSA and ECDSA keys (Vault Transit's names).

Each type has a default (SHA-256 for RSA and P-256, SHA-384 for P-384, SHA-512 for P-521); a
precomputed ``digest`` must be exactly as long as the chosen hash's output.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from cryptography.hazmat.primitives import hashes

from service.crypto.base import InvalidOptions

SHA2_256: Final = "sha2-256"
SHA2_384: Final = "sha2-384"
SHA2_512: Final = "sha2-512"

HASHES: Final[MappingProxyType[str, hashes.HashAlgorithm]] = MappingProxyType(
    {SHA2_256: hashes.SHA256(), SHA2_384: hashes.SHA384(), SHA2_512: hashes.SHA512()}
)


def choose(requested: str | None, default: str) -> str:
    """The hash name to use: ``requested`` if sent (and known), else the type's default."""
    if requested is None:
        return default
    if requested not in HASHES:
        raise InvalidOptions("hash_algorithm must be one of: " + ", ".join(HASHES))
    return requested


def check_digest(digest: bytes, name: str) -> None:
    """Refuse a precomputed digest whose length is not the hash's output size."""
    size = HASHES[name].digest_size
    if len(digest) != size:
        raise InvalidOptions(f"digest must be {size} bytes for {name}")
