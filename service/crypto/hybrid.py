"""Hybrid encryption: a public-key scheme wraps a fresh data key, an AEAD seals the data.

Body layout: wrapped_len (u16, big endian) || wrapped data key || AEAD body (nonce||ct||tag).
The associated data of the AEAD binds the cryptd context (key name, version, type), so a body
cannot be moved to another key even if the data key were known.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

from service.crypto.aead import Aead
from service.crypto.base import InvalidCiphertext

_LEN = struct.Struct(">H")


def seal(
    plaintext: bytes,
    associated_data: bytes,
    *,
    dek_size: int,
    wrap: Callable[[bytes], bytes],
    aead: Callable[[bytes], Aead],
) -> bytes:
    dek = os.urandom(dek_size)
    wrapped = wrap(dek)
    return _LEN.pack(len(wrapped)) + wrapped + aead(dek).seal(plaintext, associated_data)


def open_(
    body: bytes,
    associated_data: bytes,
    *,
    dek_size: int,
    unwrap: Callable[[bytes], bytes],
    aead: Callable[[bytes], Aead],
) -> bytes:
    """Open a hybrid body. ``unwrap`` must raise InvalidCiphertext on failure."""
    if len(body) < _LEN.size:
        raise InvalidCiphertext
    (wrapped_len,) = _LEN.unpack_from(body)
    end = _LEN.size + wrapped_len
    if len(body) < end:
        raise InvalidCiphertext
    dek = unwrap(body[_LEN.size : end])
    if len(dek) != dek_size:
        raise InvalidCiphertext
    return aead(dek).open(body[end:], associated_data)
