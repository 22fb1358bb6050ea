"""The backup of one key: every version's material and the key's metadata in one opaque blob,
encrypted and authenticated under the master key (docs/FORMAT.md, section 10)::

    blob   = "cryptd-backup" (13 ASCII) || format (u8, = 1) || master_key_id (16 ASCII hex)
             || nonce (12) || AES-256-GCM(backup key, nonce, payload, associated data = header)
    header = the first 30 bytes
    backup key = HMAC-SHA256(master key, "cryptd key backup")
    payload    = JSON, keys sorted, no whitespace:
                 {"format": "cryptd-backup/1", "name": ..., "metadata": {...},
                  "versions": [{"version": n, "created_at": "...", "material": "<base64>"}]}

Any cryptd holding the same master key restores it; the header names the master key, so a blob
made under another one is refused as such, and the format byte lets a later format be told
apart. Nothing in the blob is readable without the master key, not even the key's name.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Final

import orjson

from service.crypto.aead import NONCE_SIZE, TAG_SIZE
from service.crypto.base import InvalidCiphertext
from service.errors import InvalidRequest
from service.keys.masterkey import MasterKey

MAGIC: Final = b"cryptd-backup"
FORMAT: Final = 1
PAYLOAD_FORMAT: Final = "cryptd-backup/1"
_KEY_ID_SIZE: Final = 16
HEADER_SIZE: Final = len(MAGIC) + 1 + _KEY_ID_SIZE


# What a backup holds: the key's name, its record's metadata (without versions) and every
# version as (number, created_at, material) - the parts of the key manager's KeyExport.
Versions = tuple[tuple[int, str, bytes], ...]
Content = tuple[str, Mapping[str, Any], Versions]


def header(master: MasterKey) -> bytes:
    return MAGIC + bytes([FORMAT]) + master.key_id.encode("ascii")


def seal(master: MasterKey, name: str, metadata: Mapping[str, Any], versions: Versions) -> bytes:
    payload = orjson.dumps(
        {
            "format": PAYLOAD_FORMAT,
            "name": name,
            "metadata": dict(metadata),
            "versions": [
                {
                    "version": number,
                    "created_at": created_at,
                    "material": base64.b64encode(material).decode("ascii"),
                }
                for number, created_at, material in versions
            ],
        },
        option=orjson.OPT_SORT_KEYS,
    )
    head = header(master)
    return head + master.seal_backup(payload, head)


def key_id_of(blob: bytes) -> str | None:
    """The master key id a backup's header names (None: not a backup of this format)."""
    if len(blob) < HEADER_SIZE or not blob.startswith(MAGIC) or blob[len(MAGIC)] != FORMAT:
        return None
    return blob[len(MAGIC) + 1 : HEADER_SIZE].decode("ascii", errors="replace")


def open_(master: MasterKey, blob: bytes) -> Content:
    """The key inside ``blob``; 400 with the reason for a blob that is not a backup, of another
    format, made under another master key, or damaged."""
    if len(blob) < HEADER_SIZE + NONCE_SIZE + TAG_SIZE or not blob.startswith(MAGIC):
        raise InvalidRequest("not a cryptd key backup")
    head = blob[:HEADER_SIZE]
    if head[len(MAGIC)] != FORMAT:
        raise InvalidRequest(
            f"backup format {head[len(MAGIC)]} is not supported (this cryptd reads format {FORMAT})"
        )
    key_id = head[len(MAGIC) + 1 :].decode("ascii", errors="replace")
    if key_id != master.key_id:
        raise InvalidRequest(
            f"the backup was made under master key {key_id!r}; this cryptd holds {master.key_id!r}"
        )
    try:
        payload = master.open_backup(blob[HEADER_SIZE:], head)
    except InvalidCiphertext:
        raise InvalidRequest("the backup does not authenticate (damaged or altered)") from None
    return _parse(payload)


def _parse(payload: bytes) -> Content:
    # Authenticated under the master key, so written by a cryptd; still parsed defensively.
    try:
        data = orjson.loads(payload)
        if data["format"] != PAYLOAD_FORMAT:
            raise InvalidRequest(f"backup payload format {data['format']!r} is not supported")
        versions = tuple(
            (
                int(v["version"]),
                str(v["created_at"]),
                base64.b64decode(v["material"], validate=True),
            )
            for v in data["versions"]
        )
        name, metadata = data["name"], data["metadata"]
        if not isinstance(name, str) or not isinstance(metadata, dict):
            raise TypeError
    except InvalidRequest:
        raise
    except (KeyError, TypeError, ValueError, binascii.Error, orjson.JSONDecodeError):
        raise InvalidRequest("the backup's content is malformed") from None
    return name, metadata, versions
