"""Post-quantum key types against the classical ones in ``cryptd bench``: ops/s per operation
and the sizes a client stores or sends, measured through cryptd's own key handles
(``service/crypto``), so each figure is what one request's crypto costs the service.

The tables below are the whole choice of what is measured: a new key type is one name in
:data:`SIGNING` or :data:`ENCRYPTING`. Signing is of the benchmark's 32-byte message,
encryption of a 32-byte data key (the service's token body for it: HPKE for ML-KEM and X-Wing,
RSA-OAEP or SM2 wrapping an AES-256-GCM / SM4-GCM key), and encapsulation is the raw KEM.

The sizes are exact, made by the key types' own code: the signature, the token body, the token
as the API returns it (``cryptd:v1:`` and base64url; its characters are ASCII, one byte each),
the KEM ciphertext and the public key. :func:`sizes` gives them without timing anything;
docs/MIGRATION.md's post-quantum tables are held to them by tests/test_migration_pq_table.py.

``fast-mldsa`` (a Rust ML-DSA on PyPI, docs/PERFORMANCE.md says why the service does not use
it) is measured beside ML-DSA-65 when it is installed, as a reference only.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from service.crypto.base import NO_OPTIONS, KeyHandle
from service.crypto.registry import KEY_TYPES
from service.keys import token

Op = Callable[[], object]

SIGNING = (
    "ml-dsa-44",
    "ml-dsa-65",
    "ml-dsa-87",
    "ml-dsa-65-ecdsa-p256",
    "ml-dsa-65-ed25519",
    "ml-dsa-65-sm2",
    "rsa-2048",
    "ecdsa-p256",
    "ed25519",
    "sm2",
)
ENCRYPTING = ("ml-kem-768", "ml-kem-1024", "x25519-ml-kem-768", "rsa-2048", "rsa-3072", "sm2")
SIGN_OPERATIONS = ("sign", "verify")
ENCRYPT_OPERATIONS = ("encrypt", "decrypt", "encapsulate", "decapsulate")
SIZES = ("signature", "ciphertext", "encapsulation")  # the chart's byte panel
TOKEN_VERSION = 1  # a key's first version: ``cryptd:v1:``, as a new key's tokens read
PREFIX = "type:"  # a key type's figures in the report, apart from the SM2 tables' backends
REFERENCE = "fast-mldsa:ml-dsa-65"  # the optional outside ML-DSA-65, never the service's
MESSAGE = b"cryptd bench message, 32 bytes."
DATA_KEY_BYTES = 32


def label(type_name: str) -> str:
    return PREFIX + type_name


def _handle(type_name: str) -> KeyHandle:
    key_type = KEY_TYPES[type_name]
    return key_type.load(key_type.generate())


def signing_ops(type_name: str) -> tuple[dict[str, Op], dict[str, int | None]]:
    handle = _handle(type_name)
    signature = handle.sign(MESSAGE, prehashed=False, options=NO_OPTIONS)
    if not handle.verify(signature, MESSAGE, prehashed=False, options=NO_OPTIONS):
        raise RuntimeError(f"{type_name}: its own signature does not verify")
    ops: dict[str, Op] = {
        "sign": lambda: handle.sign(MESSAGE, prehashed=False, options=NO_OPTIONS),
        "verify": lambda: handle.verify(signature, MESSAGE, prehashed=False, options=NO_OPTIONS),
    }
    return ops, {"signature": len(signature), **public_key_size(handle)}


def encrypting_ops(type_name: str) -> tuple[dict[str, Op], dict[str, int | None]]:
    handle = _handle(type_name)
    data_key = secrets.token_bytes(DATA_KEY_BYTES)
    body = handle.encrypt(data_key, b"")
    if handle.decrypt(body, b"") != data_key:
        raise RuntimeError(f"{type_name}: decrypt does not give the data key back")
    ops: dict[str, Op] = {
        "encrypt": lambda: handle.encrypt(data_key, b""),
        "decrypt": lambda: handle.decrypt(body, b""),
    }
    sizes: dict[str, int | None] = {
        "ciphertext": len(body),
        "token": len(token.encode(TOKEN_VERSION, KEY_TYPES[type_name].type_id, body)),
        **public_key_size(handle),
    }
    if KEY_TYPES[type_name].supports("encapsulate"):
        encapsulated, secret = handle.encapsulate()
        if handle.decapsulate(encapsulated) != secret:
            raise RuntimeError(f"{type_name}: decapsulate does not give the shared secret")
        ops["encapsulate"] = handle.encapsulate
        ops["decapsulate"] = lambda: handle.decapsulate(encapsulated)
        sizes["encapsulation"] = len(encapsulated)
    return ops, sizes


def public_key_size(handle: KeyHandle) -> dict[str, int | None]:
    """``public_key``: its SubjectPublicKeyInfo DER bytes; ``public_key_raw`` instead for a type
    that has no SPKI (X-Wing: the raw ML-KEM-768 || X25519 key)."""
    pem = handle.public_key_pem()
    if pem is not None:
        body = "".join(line for line in pem.splitlines() if not line.startswith("-----"))
        return {"public_key": len(base64.b64decode(body))}
    raw = handle.public_key_raw()
    if raw is None:
        raise RuntimeError(f"{handle.type_name}: no public key")
    return {"public_key_raw": len(bytes.fromhex(raw))}


def reference_ops() -> dict[str, Op] | None:
    """fast-mldsa's ML-DSA-65 sign / verify of the same message, when it is installed."""
    try:
        import fast_mldsa  # type: ignore[import-not-found]  # optional, never a dependency
    except ImportError:
        return None
    verifying, signing = fast_mldsa.MlDsa65.key_gen()
    signature = signing.sign(MESSAGE)
    return {
        "sign": lambda: signing.sign(MESSAGE),
        "verify": lambda: verifying.verify(signature, MESSAGE),
    }


def candidates(
    types: tuple[str, ...], build: Callable[[str], tuple[dict[str, Op], dict[str, int | None]]]
) -> tuple[dict[str, dict[str, Op]], dict[str, dict[str, int | None]]]:
    ops: dict[str, dict[str, Op]] = {}
    sizes: dict[str, dict[str, int | None]] = {}
    for type_name in types:
        ops[label(type_name)], sizes[type_name] = build(type_name)
    return ops, sizes


def sizes(
    signing: tuple[str, ...] = SIGNING, encrypting: tuple[str, ...] = ENCRYPTING
) -> dict[str, dict[str, Any]]:
    """Every size the bench reports, per key type, without timing anything."""
    return merge_sizes(
        candidates(signing, signing_ops)[1], candidates(encrypting, encrypting_ops)[1]
    )


def merge_sizes(*parts: Mapping[str, Mapping[str, int | None]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for type_name, sizes in part.items():
            out.setdefault(type_name, {}).update(sizes)
    return out
