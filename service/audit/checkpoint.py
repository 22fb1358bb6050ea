"""What a checkpoint signs, and checking it.

A checkpoint is a chained line (``event`` ``audit.checkpoint``) whose ``sig`` is a signature,
by the keyring's internal key ``cryptd:audit-signing``, over the stream, its own sequence
number, its ``prev`` (which covers every line before it) and its time. The key is Ed25519 or
SM2 (SM3 with the default signer ID, DER), as it was made (``CRYPTD_AUDIT_SIGNING_KEY_TYPE``);
the key's own type decides, so a verifier needs no setting. The verifier takes the public keys
from the keyring, never from the file.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from service.crypto import sm2

SIGNING_KEY = "cryptd:audit-signing"
SIGNING_KEY_TYPE = "ed25519"  # when CRYPTD_AUDIT_SIGNING_KEY_TYPE names none
SIGNING_KEY_TYPES = ("ed25519", "sm2")
_DOMAIN = b"cryptd audit checkpoint v1\n"

Signer = Callable[[bytes], tuple[int, bytes]]
"""sign(payload) -> (signing key version, signature)."""

Verifier = Callable[[bytes, bytes], bool]
"""verify(signature, payload) -> whether it holds."""
VerifyingKey = Verifier | Ed25519PublicKey  # a pyca Ed25519 key is taken as it is


def verifier_from_pem(pem: str) -> Verifier:
    """The checkpoint verifier of a signing key version's public key (PEM); ValueError if it
    is neither Ed25519 nor SM2. pyca/cryptography refuses the SM2 curve, so SM2 goes to
    libcrypto (service.crypto.sm2)."""
    try:
        public = load_pem_public_key(pem.encode())
    except (ValueError, UnsupportedAlgorithm):
        public = None
    if isinstance(public, Ed25519PublicKey):
        return _ed25519(public)
    found = sm2.load_public_pem(pem) if public is None else None
    if found is None:
        raise ValueError("not an Ed25519 or SM2 public key")
    return found.verify


def _ed25519(public: Ed25519PublicKey) -> Verifier:
    def verify(signature: bytes, data: bytes) -> bool:
        try:
            public.verify(signature, data)
        except InvalidSignature:
            return False
        return True

    return verify


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


def check(record: Mapping[str, object], keys: Mapping[int, VerifyingKey]) -> str | None:
    """None when the checkpoint's signature holds under the key version it names, else why."""
    stream, seq, prev, ts = (record.get(name) for name in ("stream", "seq", "prev", "ts"))
    version, sig = record.get("signer_version"), record.get("sig")
    if not (isinstance(stream, str) and isinstance(seq, int) and isinstance(prev, str)):
        return "malformed checkpoint"
    if not (isinstance(ts, str) and isinstance(version, int) and isinstance(sig, str)):
        return "malformed checkpoint"
    key = keys.get(version)
    if isinstance(key, Ed25519PublicKey):
        key = _ed25519(key)
    if key is None:
        return f"checkpoint signed by unknown version {version} of {SIGNING_KEY}"
    try:
        signature = base64.b64decode(sig, validate=True)
    except ValueError:
        return "checkpoint signature does not verify"
    if not key(signature, payload(stream, seq, prev, ts)):
        return "checkpoint signature does not verify"
    return None
