"""Composite ML-DSA keys over HTTP against a real server: sign and verify with and without a
context, each half checked outside cryptd (dilithium-py over M', pyca for ECDSA and Ed25519,
gmssl for SM2), one tampered half or a truncated signature giving ``{valid: false}``, the
options composites refuse (400), and import of the draft's published keys, whose published
signatures verify."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from dilithium_py.ml_dsa import ML_DSA_65

from service.cli import main
from tests.conftest import Server
from tests.test_api import assert_error
from tests.test_byok import b64, import_key, ok
from tests.test_crypto_vectors_composite import (
    CASES,
    CONTEXT,
    LABELS,
    MESSAGE,
    MLDSA_PK,
    MLDSA_SIG,
    TYPES,
    flip,
    m_prime,
    trad_verifies,
)

pytestmark = pytest.mark.slow  # a live server


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def latest(server: Server, name: str) -> dict[str, Any]:
    entry: dict[str, Any] = ok(server.request("GET", f"/v1/keys/{name}"))["versions"][-1]
    return entry


@pytest.mark.parametrize("type_name", TYPES)
def test_sign_verify_and_tampering(server: Server, type_name: str) -> None:
    name = f"cmp-{type_name}"
    ok(server.request("POST", f"/v1/keys/{name}", {"type": type_name}), 201)
    entry = latest(server, name)
    public = bytes.fromhex(entry["public_key_raw"])
    assert entry["public_key_pem"].startswith(
        "-----BEGIN ML-DSA-65-SM2 PUBLIC KEY-----"
        if type_name == "ml-dsa-65-sm2"
        else "-----BEGIN PUBLIC KEY-----"
    )
    message, context = os.urandom(200), b"invoice:2026"
    with_context = {"message": b64(message), "context": b64(context)}
    plain = {"message": b64(message)}
    signature = unb64(ok(server.request("POST", f"/v1/sign/{name}", with_context))["signature"])
    unbound = unb64(ok(server.request("POST", f"/v1/sign/{name}", plain))["signature"])
    # Each half, outside cryptd, over M' as the draft builds it.
    for signed, ctx in ((signature, context), (unbound, b"")):
        representative = m_prime(type_name, message, ctx)
        first, second = signed[:MLDSA_SIG], signed[MLDSA_SIG:]
        assert ML_DSA_65.verify(public[:MLDSA_PK], representative, first, ctx=LABELS[type_name])
        assert trad_verifies(type_name, public[MLDSA_PK:], second, representative)
    batch = [
        {**with_context, "signature": b64(signature)},
        {**plain, "signature": b64(unbound)},
        {**plain, "signature": b64(signature)},  # context missing
        {**with_context, "signature": b64(flip(signature, 10))},  # ML-DSA half tampered
        {**with_context, "signature": b64(flip(signature, len(signature) - 3))},  # traditional
        {**with_context, "signature": b64(signature[:-1])},
        {**with_context, "signature": b64(signature[:MLDSA_SIG])},
        {**with_context, "signature": b64(signature[:100])},
        {**with_context, "signature": b64(unbound[:MLDSA_SIG] + signature[MLDSA_SIG:])},
    ]
    answers = ok(server.request("POST", f"/v1/verify/{name}", {"batch": batch}))["batch"]
    assert answers == [{"valid": True}, {"valid": True}] + [{"valid": False}] * 7
    single = server.request(
        "POST", f"/v1/verify/{name}", {**plain, "signature": b64(flip(unbound, MLDSA_SIG + 6))}
    )
    assert ok(single) == {"valid": False}


def test_options_composites_refuse_are_400(server: Server) -> None:
    ok(server.request("POST", "/v1/keys/cmp-bad", {"type": "ml-dsa-65-ed25519"}), 201)
    signature = b64(bytes(3373))
    cases = [
        ({"message": b64(b"m"), "context": b64(b"c" * 256)}, "255"),
        ({"message": b64(bytes(64)), "message_type": "external_mu"}, "message_type"),
        ({"digest": b64(bytes(64))}, "messages only"),
        ({"message": b64(b"m"), "hash_algorithm": "sha2-256"}, "hash_algorithm"),
        ({"message": b64(b"m"), "encoding": "raw"}, "encoding"),
    ]
    for body, text in cases:
        for op, extra in (("sign", {}), ("verify", {"signature": signature})):
            answer = server.request("POST", f"/v1/{op}/cmp-bad", {**body, **extra})
            assert_error(answer, 400, "invalid_request")
            assert text in answer.json()["error"]["message"], (op, body, answer.text)
    raw = {"message": b64(b"m"), "message_type": "raw"}
    signed = ok(server.request("POST", "/v1/sign/cmp-bad", raw))
    assert signed["key_version"] == 1
    verified = server.request(
        "POST", "/v1/verify/cmp-bad", {**raw, "signature": signed["signature"]}
    )
    assert ok(verified) == {"valid": True}


@pytest.mark.parametrize("type_name", TYPES)
def test_imported_vector_keys_verify_the_published_signatures(
    server: Server, type_name: str
) -> None:
    """The draft's keys (PKCS#8 for the draft types, the raw composite key for SM2) imported
    through BYOK give the published public key; the published signatures verify, and a
    signature cryptd makes with the imported key verifies outside cryptd."""
    case = CASES[type_name]
    material = unb64(case["sk_pkcs8"] if "sk_pkcs8" in case else case["sk"])
    name = f"cmp-imported-{type_name}"
    ok(import_key(server, name, type_name, material), 201)
    public = bytes.fromhex(latest(server, name)["public_key_raw"])
    assert public == unb64(case["pk"])
    batch = [
        {"message": b64(MESSAGE), "signature": case["s"]},
        {"message": b64(MESSAGE), "context": b64(CONTEXT), "signature": case["sWithContext"]},
        {"message": b64(MESSAGE), "context": b64(CONTEXT), "signature": case["s"]},
    ]
    answers = ok(server.request("POST", f"/v1/verify/{name}", {"batch": batch}))["batch"]
    assert answers == [{"valid": True}, {"valid": True}, {"valid": False}]
    signed = ok(server.request("POST", f"/v1/sign/{name}", {"message": b64(MESSAGE)}))
    signature = unb64(signed["signature"])
    representative = m_prime(type_name, MESSAGE)
    assert ML_DSA_65.verify(
        public[:MLDSA_PK], representative, signature[:MLDSA_SIG], ctx=LABELS[type_name]
    )
    assert trad_verifies(type_name, public[MLDSA_PK:], signature[MLDSA_SIG:], representative)


@pytest.mark.parametrize(
    ("type_name", "material"),
    [
        ("ml-dsa-65-ed25519", os.urandom(63)),
        ("ml-dsa-65-sm2", os.urandom(32)),
        ("ml-dsa-65-ecdsa-p256", os.urandom(32) + bytes(51)),
    ],
)
def test_bad_import_is_400_and_stores_nothing(
    server: Server, type_name: str, material: bytes
) -> None:
    name = f"cmp-wrong-{type_name}"
    assert_error(import_key(server, name, type_name, material), 400, "invalid_request")
    assert_error(server.request("GET", f"/v1/keys/{name}"), 404, "key_not_found")


def test_cli_signs_and_verifies_with_a_context(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    ok(server.request("POST", "/v1/keys/cmp-cli", {"type": "ml-dsa-65-sm2"}), 201)
    public = bytes.fromhex(latest(server, "cmp-cli")["public_key_raw"])
    cred = ["--credential", str(server.directory / "dev" / "client.json")]

    def call(*args: str) -> tuple[int, Any]:
        status = main(["call", *args, *cred])
        out = capsys.readouterr().out
        return status, json.loads(out) if out.strip() else None

    status, signed = call("sign", "cmp-cli", "--data", "hello", "--context", "app:v1")
    assert status == 0
    signature = unb64(signed["signature"])
    representative = m_prime("ml-dsa-65-sm2", b"hello", b"app:v1")
    assert ML_DSA_65.verify(
        public[:MLDSA_PK], representative, signature[:MLDSA_SIG], ctx=LABELS["ml-dsa-65-sm2"]
    )
    assert trad_verifies("ml-dsa-65-sm2", public[MLDSA_PK:], signature[MLDSA_SIG:], representative)
    verify = ("verify", "cmp-cli", "--data", "hello", "--signature", signed["signature"])
    assert call(*verify, "--context", "app:v1") == (0, {"valid": True})
    assert call(*verify) == (1, {"valid": False})
