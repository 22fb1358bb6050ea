"""The scenarios, described once for both targets: path and JSON body for cryptd and for
OpenBao's Transit engine. The wrk scripts carry the same bodies for standalone use; the runner
always hands wrk the bodies built here (decrypt bodies need a ciphertext made by the target,
verify bodies a signature) and the path.

The post-quantum scenarios are made from two tables, :data:`PQ_SIGNING` and :data:`PQ_KEMS`:
a new signing or KEM key type is one line there (its cryptd key, and OpenBao's Transit type
when it has one). They are not in the default run (``--scenarios pq`` or by name).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

PAYLOAD_BYTES: Final = 1024  # the "1 KiB" of the AES scenarios
MESSAGE_BYTES: Final = 32  # message signed by the sign scenarios
SECRET_BYTES: Final = 32  # plaintext of the RSA decrypt scenarios: a data key
BATCH_ITEMS: Final = 100

# Post-quantum key types measured by the runner: (cryptd key type, OpenBao Transit key type or
# None when OpenBao has none). The development keyring names each key after its type.
PQ_SIGNING: Final[tuple[tuple[str, str | None], ...]] = (
    ("ml-dsa-44", "mldsa-44"),
    ("ml-dsa-65", "mldsa-65"),
    ("ml-dsa-87", "mldsa-87"),
    # Composite ML-DSA-65 + a classical signature: OpenBao has none.
    ("ml-dsa-65-ecdsa-p256", None),
    ("ml-dsa-65-ed25519", None),
    ("ml-dsa-65-sm2", None),
)
# OpenBao 2.7's Transit has no ML-KEM or X-Wing key type: these run against cryptd only.
PQ_KEMS: Final[tuple[str, ...]] = ("ml-kem-768", "ml-kem-1024", "x25519-ml-kem-768")

# OpenBao Transit key names and types (created by the runner).
OPENBAO_KEYS: Final = {
    "aes": "aes256-gcm96",
    "rsa-2048": "rsa-2048",
    "ecdsa-p256": "ecdsa-p256",
    "ed25519": "ed25519",
    **{bao: bao for _, bao in PQ_SIGNING if bao is not None},
}


def payload(size: int) -> bytes:
    """Deterministic filler (the same formula as loadtest/wrk/common.lua): only sizes matter."""
    return bytes(((i + 1) * 131 + 7) % 256 for i in range(size))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


Body = dict[str, Any]


@dataclass(frozen=True)
class Endpoint:
    """One request shape against one target. ``ciphertext_of`` says which plaintext the target
    must encrypt first (decrypt scenarios); the body then gets that ciphertext."""

    path: str
    body: Callable[[str | None], Body]
    encrypt_path: str | None = None
    encrypt_body: Body | None = None
    made: str = "ciphertext"  # the field of the first answer the body takes ("signature")

    def made_in(self, answer: Any) -> str:
        """The value the body needs from the first request's answer (cryptd's, or OpenBao's
        under ``data``)."""
        found = answer[self.made] if self.made in answer else answer["data"][self.made]
        return str(found)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    cryptd: Endpoint
    openbao: Endpoint | None  # None: OpenBao has no counterpart (SM2)
    items: int = 1  # operations per request (batch)


def _fixed(body: Body) -> Callable[[str | None], Body]:
    return lambda _ciphertext: body


def _ciphertext_body(ciphertext: str | None) -> Body:
    if ciphertext is None:
        raise ValueError("a decrypt scenario needs a ciphertext")
    return {"ciphertext": ciphertext}


_PLAINTEXT = b64(payload(PAYLOAD_BYTES))
_MESSAGE = b64(payload(MESSAGE_BYTES))
_SECRET = b64(payload(SECRET_BYTES))

_CLASSIC: Final[tuple[Scenario, ...]] = (
    Scenario(
        "aes-encrypt",
        "AES-256-GCM encrypt 1 KiB",
        Endpoint("/v1/encrypt/aes256-gcm", _fixed({"plaintext": _PLAINTEXT})),
        Endpoint("/v1/transit/encrypt/aes", _fixed({"plaintext": _PLAINTEXT})),
    ),
    Scenario(
        "aes-decrypt",
        "AES-256-GCM decrypt 1 KiB",
        Endpoint(
            "/v1/decrypt/aes256-gcm",
            _ciphertext_body,
            "/v1/encrypt/aes256-gcm",
            {"plaintext": _PLAINTEXT},
        ),
        Endpoint(
            "/v1/transit/decrypt/aes",
            _ciphertext_body,
            "/v1/transit/encrypt/aes",
            {"plaintext": _PLAINTEXT},
        ),
    ),
    Scenario(
        "rsa-sign",
        "RSA-2048 sign (PSS, SHA-256)",
        Endpoint("/v1/sign/rsa-2048", _fixed({"message": _MESSAGE, "algorithm": "pss"})),
        Endpoint(
            "/v1/transit/sign/rsa-2048/sha2-256",
            _fixed({"input": _MESSAGE, "signature_algorithm": "pss"}),
        ),
    ),
    Scenario(
        "rsa-decrypt",
        "RSA-2048 decrypt (32 B)",
        Endpoint(
            "/v1/decrypt/rsa-2048", _ciphertext_body, "/v1/encrypt/rsa-2048", {"plaintext": _SECRET}
        ),
        Endpoint(
            "/v1/transit/decrypt/rsa-2048",
            _ciphertext_body,
            "/v1/transit/encrypt/rsa-2048",
            {"plaintext": _SECRET},
        ),
    ),
    Scenario(
        "ecdsa-sign",
        "ECDSA-P256 sign",
        Endpoint("/v1/sign/ecdsa-p256", _fixed({"message": _MESSAGE})),
        Endpoint("/v1/transit/sign/ecdsa-p256/sha2-256", _fixed({"input": _MESSAGE})),
    ),
    Scenario(
        "ed25519-sign",
        "Ed25519 sign",
        Endpoint("/v1/sign/ed25519", _fixed({"message": _MESSAGE})),
        Endpoint("/v1/transit/sign/ed25519", _fixed({"input": _MESSAGE})),
    ),
    Scenario(
        "sm2-sign",
        "SM2 sign (cryptd only)",
        Endpoint("/v1/sign/sm2", _fixed({"message": _MESSAGE})),
        None,
    ),
    Scenario(
        "aes-batch",
        "AES-256-GCM batch 100 x 1 KiB",
        Endpoint(
            "/v1/encrypt/aes256-gcm",
            _fixed({"batch": [{"plaintext": _PLAINTEXT}] * BATCH_ITEMS}),
        ),
        Endpoint(
            "/v1/transit/encrypt/aes",
            _fixed({"batch_input": [{"plaintext": _PLAINTEXT}] * BATCH_ITEMS}),
        ),
        items=BATCH_ITEMS,
    ),
)


def _signature_body(message_field: str) -> Callable[[str | None], Body]:
    def body(signature: str | None) -> Body:
        if signature is None:
            raise ValueError("a verify scenario needs a signature")
        return {message_field: _MESSAGE, "signature": signature}

    return body


def _signing(key: str, bao: str | None) -> tuple[Scenario, Scenario]:
    """Sign and verify of a 32-byte message with ``key``; OpenBao's ``bao`` key beside it."""
    title = key.upper()
    sign = Scenario(
        f"{key}-sign",
        f"{title} sign",
        Endpoint(f"/v1/sign/{key}", _fixed({"message": _MESSAGE})),
        None if bao is None else Endpoint(f"/v1/transit/sign/{bao}", _fixed({"input": _MESSAGE})),
    )
    verify = Scenario(
        f"{key}-verify",
        f"{title} verify",
        Endpoint(
            f"/v1/verify/{key}",
            _signature_body("message"),
            f"/v1/sign/{key}",
            {"message": _MESSAGE},
            made="signature",
        ),
        None
        if bao is None
        else Endpoint(
            f"/v1/transit/verify/{bao}",
            _signature_body("input"),
            f"/v1/transit/sign/{bao}",
            {"input": _MESSAGE},
            made="signature",
        ),
    )
    return sign, verify


def _kem(key: str) -> tuple[Scenario, ...]:
    """HPKE encrypt / decrypt of a 32-byte data key, and raw encapsulate / decapsulate."""
    title = "X-Wing" if key == "x25519-ml-kem-768" else key.upper()
    return (
        Scenario(
            f"{key}-encrypt",
            f"{title} encrypt (32 B)",
            Endpoint(f"/v1/encrypt/{key}", _fixed({"plaintext": _SECRET})),
            None,
        ),
        Scenario(
            f"{key}-decrypt",
            f"{title} decrypt (32 B)",
            Endpoint(
                f"/v1/decrypt/{key}", _ciphertext_body, f"/v1/encrypt/{key}", {"plaintext": _SECRET}
            ),
            None,
        ),
        Scenario(
            f"{key}-encapsulate",
            f"{title} encapsulate",
            Endpoint(f"/v1/encapsulate/{key}", _fixed({})),
            None,
        ),
        Scenario(
            f"{key}-decapsulate",
            f"{title} decapsulate",
            Endpoint(f"/v1/decapsulate/{key}", _ciphertext_body, f"/v1/encapsulate/{key}", {}),
            None,
        ),
    )


PQ_SCENARIOS: Final[tuple[Scenario, ...]] = (
    *(s for key, bao in PQ_SIGNING for s in _signing(key, bao)),
    *(s for key in PQ_KEMS for s in _kem(key)),
)
# The scenarios of a default run (``--scenarios`` names others, ``pq`` all of PQ_SCENARIOS).
DEFAULT_SCENARIOS: Final = tuple(s.name for s in _CLASSIC)
SCENARIOS: Final = (*_CLASSIC, *PQ_SCENARIOS)

BY_NAME: Final = {scenario.name: scenario for scenario in SCENARIOS}
GROUPS: Final = {"pq": tuple(s.name for s in PQ_SCENARIOS)}

# The origin case study: RSA-2048 hybrid decryption at a fixed offered rate (open loop).
CASE_STUDY: Final = BY_NAME["rsa-decrypt"]


@dataclass(frozen=True)
class Mix:
    """Several scenarios at once against one target, each with its own connections (one wrk
    process per stream). ``alone`` is the stream whose latency is also measured by itself, at
    the same connection count, to show what the other streams do to it."""

    name: str
    title: str
    streams: tuple[tuple[str, int], ...]  # (scenario name, connections)
    alone: str


MIXES: Final[tuple[Mix, ...]] = (
    Mix(
        "mix",
        "AES-256-GCM encrypt 1 KiB + RSA-2048 sign at once (8 + 8 connections)",
        (("aes-encrypt", 8), ("rsa-sign", 8)),
        alone="aes-encrypt",
    ),
)
MIX_BY_NAME: Final = {mix.name: mix for mix in MIXES}
