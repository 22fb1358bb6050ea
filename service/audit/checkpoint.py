"""What a checkpoint signs, and checking it.

A checkpoint is a chained line (``event`` ``audit.checkpoint``) whose ``sig`` is an Ed25519
signature, by the keyring's internal key ``cryptd:audit-signing``, over the stream, its own
sequence number, its ``prev`` (which covers every line before it) and its time. The verifier
takes the public keys from the keyring, never from the file.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

SIGNING_KEY = "cryptd:audit-signing"
SIGNING_KEY_TYPE = "ed25519"
_DOMAIN = b"cryptd audit checkpoint v1\n"

Signer = Callable[[bytes], tuple[int, bytes]]
"""sign(payload) -> (signing key version, signature)."""


def payload(stream: str, seq: int, prev: str, ts: str) -> bytes:
    return _DOMAIN + "\n".join((stream, str(seq), prev, ts)).encode()


def fields(stream: str, seq: int, prev: str, ts: str, signer: Signer) -> dict[str, object]:
    """The checkpoint line's fields after ``seq`` and ``prev``."""
    version, signature = signer(payload(stream, seq, prev, ts))
    return {
        "ts": ts,
        "event": "audit.checkpoint",
        "stream": stream,
        "signer": SIGNING_KEY,
        "signer_version": version,
        "sig": base64.b64encode(signature).decode(),
    }


def check(record: Mapping[str, object], keys: Mapping[int, Ed25519PublicKey]) -> str | None:
    """None when the checkpoint's signature holds under the key version it names, else why."""
    stream, seq, prev, ts = (record.get(name) for name in ("stream", "seq", "prev", "ts"))
    version, sig = record.get("signer_version"), record.get("sig")
    if not (isinstance(stream, str) and isinstance(seq, int) and isinstance(prev, str)):
        return "malformed checkpoint"
    if not (isinstance(ts, str) and isinstance(version, int) and isinstance(sig, str)):
        return "malformed checkpoint"
    key = keys.get(version)
    if key is None:
        return f"checkpoint signed by unknown version {version} of {SIGNING_KEY}"
    try:
        key.verify(base64.b64decode(sig, validate=True), payload(stream, seq, prev, ts))
    except (InvalidSignature, ValueError):
        return "checkpoint signature does not verify"
    return None
