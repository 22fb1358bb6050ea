"""The wrapped master key at rest: a small JSON file, useless without the seal's key.

It sits beside the keyring file unless ``CRYPTD_SEALED_MASTER_KEY_FILE`` names another place
(replicas sharing a PostgreSQL key store each get a copy, as they get the client list). The
associated data binds the ciphertext to the seal and the wrapping key's label, so a file made
for another key or seal is refused, never opened into a wrong master key.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path

import orjson

from service.fileio import atomic_write
from service.seal.base import SealError

FORMAT = "cryptd-sealed-master-key/1"


@dataclass(frozen=True)
class SealedKey:
    seal: str
    key_label: str
    nonce: bytes
    ciphertext: bytes  # the GCM tag included
    key_id: str  # the master key's public fingerprint (MasterKey.key_id)

    def associated_data(self) -> bytes:
        return b"%s\x00%s\x00%s" % (FORMAT.encode(), self.seal.encode(), self.key_label.encode())


def associated_data(seal: str, key_label: str) -> bytes:
    return SealedKey(seal, key_label, b"", b"", "").associated_data()


def read(path: Path) -> SealedKey:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SealError(
            f"no wrapped master key at {path}: run `cryptd operator init` first, or set "
            "CRYPTD_SEALED_MASTER_KEY_FILE to where it is"
        ) from None
    except OSError as exc:
        raise SealError(f"the wrapped master key {path} cannot be read ({exc.strerror})") from None
    try:
        raw = orjson.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError
        return SealedKey(
            seal=str(raw["seal"]),
            key_label=str(raw["key_label"]),
            nonce=base64.b64decode(raw["nonce"], validate=True),
            ciphertext=base64.b64decode(raw["ciphertext"], validate=True),
            key_id=str(raw["key_id"]),
        )
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise SealError(f"{path} is not a cryptd wrapped master key ({FORMAT})") from None


def refuse_existing(path: Path) -> None:
    if path.exists():
        raise SealError(
            f"a wrapped master key already exists at {path}: the key store was (or may have "
            "been) written under it; move it away only if you mean to start over"
        )


def write(path: Path, sealed: SealedKey, *, replace: bool = False) -> None:
    """Write atomically; refuse to replace an existing file unless ``replace``."""
    if not replace:
        refuse_existing(path)
    document = {
        "format": FORMAT,
        "seal": sealed.seal,
        "key_label": sealed.key_label,
        "key_id": sealed.key_id,
        "nonce": base64.b64encode(sealed.nonce).decode(),
        "ciphertext": base64.b64encode(sealed.ciphertext).decode(),
    }
    atomic_write(path, orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n", mode=0o644)
