"""The ciphertext token: ``cryptd:v<version>:<base64url(body), no padding>``.

Binary body (documented with vectors in docs/FORMAT.md):

    format (u8, = 1) || key type id (u8) || algorithm body

The associated data given to every AEAD is :func:`associated_data`, which binds the token to the
key's name, version and type, plus the caller's ``aad``; a token therefore never decrypts under
another key, another version, or with another ``aad``.

An HMAC is written the same way, ``cryptd:v<version>:<base64url(tag), no padding>``, with the
tag alone (no header), so that anyone holding the key can compute it with any HMAC library.
"""

from __future__ import annotations

import re
import struct

from service import b64
from service.errors import DecryptionFailed, InvalidRequest

PREFIX = "cryptd:v"
FORMAT = 1
_HEADER = struct.Struct(">BB")
_TOKEN = re.compile(r"cryptd:v([1-9][0-9]{0,9}):([A-Za-z0-9_-]+)\Z")
# The prefix alone: the regular expression engine walks the base64url text a character at a
# time (31k instructions for a 1 KiB token, 7 % of its decrypt request); the decoder checks the
# alphabet far faster, and _TOKEN tells the two refusals apart only once it has refused.
_HEAD = re.compile(r"cryptd:v([1-9][0-9]{0,9}):")


def encode(version: int, type_id: int, body: bytes) -> str:
    data = _HEADER.pack(FORMAT, type_id) + body
    return f"{PREFIX}{version}:{b64.encode_url(data)}"


def decode(token: str) -> tuple[int, int, bytes]:
    """Return (version, type id, algorithm body).

    A string that is not a token at all is a bad request; a well-formed token whose binary
    part is damaged fails like any other decryption (no oracle).
    """
    split = _split(token)
    if split is None:
        raise InvalidRequest("ciphertext is not a cryptd token (cryptd:v<N>:<base64url>)")
    version, data = split
    # One token, one spelling: texts whose unused trailing bits are set decode to None.
    if data is None or len(data) < _HEADER.size:
        raise DecryptionFailed
    fmt, type_id = _HEADER.unpack_from(data)
    if fmt != FORMAT:
        raise DecryptionFailed
    return version, type_id, data[_HEADER.size :]


def encode_mac(version: int, tag: bytes) -> str:
    return f"{PREFIX}{version}:{b64.encode_url(tag)}"


def decode_mac(text: str) -> tuple[int, bytes | None]:
    """(version, tag). A text that is not a cryptd MAC is a bad request; a well-formed one whose
    base64url is not canonical gives no tag (it verifies as false, like any wrong tag)."""
    split = _split(text)
    if split is None:
        raise InvalidRequest("mac is not a cryptd MAC (cryptd:v<N>:<base64url>)")
    return split


def _split(text: str) -> tuple[int, bytes | None] | None:
    """(version, decoded base64url) of a text that matches _TOKEN, None for any other text; the
    bytes are None when the base64url does not decode, or not canonically."""
    head = _HEAD.match(text)
    if head is None or len(text) == head.end():
        return None
    try:
        return int(head.group(1)), b64.decode_url_canonical(text[head.end() :])
    except ValueError:
        # Refused by the decoder: a character outside the alphabet (not a token at all) or an
        # impossible length or spelling (a damaged token).
        return None if _TOKEN.match(text) is None else (int(head.group(1)), None)


def named_version(text: str) -> int | None:
    """The version a token or MAC names, without decoding it (None: not a token)."""
    match = _TOKEN.match(text)
    return None if match is None else int(match.group(1))


def associated_data(name: str, version: int, type_id: int, aad: bytes) -> bytes:
    """Context bound into every AEAD: all fields before ``aad`` are length-delimited."""
    encoded = name.encode()
    return b"cryptd/1" + struct.pack(">BBI", type_id, len(encoded), version) + encoded + aad
