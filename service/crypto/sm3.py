"""SM3 (GB/T 32905) through pyca/cryptography."""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes

DIGEST_SIZE = 32


def sm3(data: bytes, *more: bytes) -> bytes:
    """SM3 of the concatenation of the arguments (without building it: messages may be large)."""
    digest = hashes.Hash(hashes.SM3())
    digest.update(data)
    for chunk in more:
        digest.update(chunk)
    return digest.finalize()
