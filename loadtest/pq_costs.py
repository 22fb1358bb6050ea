"""``python -m loadtest.pq_costs``: what moving to post-quantum keys costs, in bytes and time.

Sizes are exact: real tokens and signatures made by the key types' own code (the token as the
API returns it, ``cryptd:v1:`` and base64url included). Times are one operation in this
process, no HTTP, each the median of ``--rounds`` runs of ``--seconds``, beside RSA-2048
measured in the same run (its ratio is what carries from one machine to another; the absolute
times are this machine's, and a loaded machine's are worth little).
"""

from __future__ import annotations

import argparse
import base64
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence

from service.crypto.base import NO_OPTIONS, KeyHandle
from service.crypto.registry import KEY_TYPES
from service.keys import token

ENCRYPTING = ("rsa-2048", "rsa-3072", "sm2", "ml-kem-768", "x25519-ml-kem-768", "ml-kem-1024")
SIGNING = ("rsa-2048", "ecdsa-p256", "ed25519", "sm2", "ml-dsa-44", "ml-dsa-65", "ml-dsa-87")
REFERENCE = "rsa-2048"
DATA_KEY = 32  # the plaintext of a 256-bit data key (datakey, envelope encryption)
AAD = b"row-1"
MESSAGE = b"x" * 100


def _handle(type_name: str) -> KeyHandle:
    kind = KEY_TYPES[type_name]
    return kind.load(kind.generate())


def _rate(call: Callable[[], object], seconds: float, rounds: int) -> float:
    """Median seconds per call over ``rounds`` timed runs of about ``seconds`` each."""
    call()  # warm
    per_call: list[float] = []
    for _ in range(rounds):
        count = 0
        started = time.perf_counter()
        deadline = started + seconds
        while True:
            call()
            count += 1
            now = time.perf_counter()
            if now >= deadline:
                break
        per_call.append((now - started) / count)
    return statistics.median(per_call)


def encryption_rows(seconds: float, rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name in ENCRYPTING:
        handle, kind = _handle(name), KEY_TYPES[name]
        dek = os.urandom(DATA_KEY)
        body = handle.encrypt(dek, AAD)
        assert handle.decrypt(body, AAD) == dek
        seal, opened = _encrypt_calls(handle, dek, body)
        rows.append(
            {
                "type": name,
                "token_chars": len(token.encode(1, kind.type_id, body)),
                "body_bytes": len(body),
                "public_key_bytes": _public_size(handle),
                "encrypt_s": _rate(seal, seconds, rounds),
                "decrypt_s": _rate(opened, seconds, rounds),
            }
        )
    return rows


def _encrypt_calls(
    handle: KeyHandle, dek: bytes, body: bytes
) -> tuple[Callable[[], object], Callable[[], object]]:
    def seal() -> object:
        return handle.encrypt(dek, AAD)

    def opened() -> object:
        return handle.decrypt(body, AAD)

    return seal, opened


def _sign_calls(handle: KeyHandle) -> tuple[Callable[[], bytes], Callable[[bytes], bool]]:
    def sign() -> bytes:
        return handle.sign(MESSAGE, prehashed=False, options=NO_OPTIONS)

    def verify(signature: bytes) -> bool:
        return handle.verify(signature, MESSAGE, prehashed=False, options=NO_OPTIONS)

    return sign, verify


def signing_rows(seconds: float, rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name in SIGNING:
        handle = _handle(name)
        sign, verify = _sign_calls(handle)
        signature = sign()
        assert verify(signature)
        rows.append(
            {
                "type": name,
                "signature_bytes": len(signature),
                "public_key_bytes": _public_size(handle),
                "sign_s": _rate(sign, seconds, rounds),
                "verify_s": _rate(functools.partial(verify, signature), seconds, rounds),
            }
        )
    return rows


def _public_size(handle: KeyHandle) -> str:
    """The public key's SubjectPublicKeyInfo DER size, or its raw size where it has no SPKI."""
    pem = handle.public_key_pem()
    if pem is not None:
        body = "".join(line for line in pem.splitlines() if not line.startswith("-----"))
        return f"{len(base64.b64decode(body)):,}"
    raw = handle.public_key_raw()
    assert raw is not None
    return f"{len(bytes.fromhex(raw)):,} raw"


def _us(seconds: object) -> str:
    assert isinstance(seconds, float)
    return f"{seconds * 1e6:,.0f}"


def _ratio(value: object, reference: object) -> str:
    assert isinstance(value, float)
    assert isinstance(reference, float)
    return f"{value / reference:.2f}"


def render(encryption: list[dict[str, object]], signing: list[dict[str, object]]) -> str:
    ref_e = next(r for r in encryption if r["type"] == REFERENCE)
    ref_s = next(r for r in signing if r["type"] == REFERENCE)
    lines = [
        f"Wrapping a {DATA_KEY}-byte data key (aad {len(AAD)} bytes); times per operation, "
        f"in-process; x = ratio to {REFERENCE} in this run",
        "",
        "| key type | token (chars) | body (bytes) | public key (DER bytes) "
        "| encrypt µs | x | decrypt µs | x |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in encryption:
        lines.append(
            f"| `{r['type']}` | {r['token_chars']:,} | {r['body_bytes']:,} "
            f"| {r['public_key_bytes']} | {_us(r['encrypt_s'])} "
            f"| {_ratio(r['encrypt_s'], ref_e['encrypt_s'])} | {_us(r['decrypt_s'])} "
            f"| {_ratio(r['decrypt_s'], ref_e['decrypt_s'])} |"
        )
    lines += [
        "",
        f"Signing a {len(MESSAGE)}-byte message (default options)",
        "",
        "| key type | signature (bytes) | public key (DER bytes) | sign µs | x | verify µs | x |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in signing:
        lines.append(
            f"| `{r['type']}` | {r['signature_bytes']:,} | {r['public_key_bytes']} "
            f"| {_us(r['sign_s'])} | {_ratio(r['sign_s'], ref_s['sign_s'])} "
            f"| {_us(r['verify_s'])} | {_ratio(r['verify_s'], ref_s['verify_s'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.pq_costs", description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0, help="per timed run (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per operation")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("--seconds must be positive and --rounds at least 1")
    encryption = encryption_rows(args.seconds, args.rounds)
    print(render(encryption, signing_rows(args.seconds, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
