"""Post-quantum keys over HTTP against a real server, checked by independent implementations.

Outside peers: dilithium-py (ML-DSA) and kyber-py (ML-KEM) from PyPI; @noble/post-quantum and
hpke-js (@hpke/core, @hpke/ml-kem, @hpke/hybridkem-x-wing) from npm, run by node on
tests/js/pq_peer.mjs (``npm ci --prefix tests/js``; .ci/run installs it). Under CI=true a
missing node or module is a failure, never a skip.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import mldsa
from dilithium_py.ml_dsa import ML_DSA_44, ML_DSA_65, ML_DSA_87
from kyber_py.ml_kem import ML_KEM_768, ML_KEM_1024

from service.cli import main
from tests.conftest import Server
from tests.test_api import assert_error
from tests.test_api_parity import add_client
from tests.test_byok import b64, import_key, ok

pytestmark = pytest.mark.slow  # a live server and node

JS = Path(__file__).parent / "js"
DILITHIUM = {"ml-dsa-44": ML_DSA_44, "ml-dsa-65": ML_DSA_65, "ml-dsa-87": ML_DSA_87}
KYBER = {"ml-kem-768": ML_KEM_768, "ml-kem-1024": ML_KEM_1024}
TYPE_IDS = {"ml-kem-768": 17, "ml-kem-1024": 18, "x25519-ml-kem-768": 19}
ENC = {"ml-kem-768": 1088, "ml-kem-1024": 1568, "x25519-ml-kem-768": 1120}


def peer(commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run commands in the node peers (one process for the lot)."""
    if shutil.which("node") is None or not (JS / "node_modules" / "@hpke" / "core").is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail("node and tests/js/node_modules are required (npm ci --prefix tests/js)")
        pytest.skip("node or tests/js/node_modules missing (npm ci --prefix tests/js)")
    done = subprocess.run(
        ["node", str(JS / "pq_peer.mjs")],
        input=json.dumps(commands).encode(),
        capture_output=True,
        check=True,
        timeout=120,
    )
    answers: list[dict[str, Any]] = json.loads(done.stdout)
    for answer in answers:
        assert "error" not in answer, answer
    return answers


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def token_body(token: str, type_name: str) -> tuple[int, bytes]:
    """docs/FORMAT.md: cryptd:v<N>:<base64url(0x01 || type id || enc || ciphertext)>."""
    _, version, text = token.split(":")
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    assert data[:2] == bytes([1, TYPE_IDS[type_name]])
    return int(version[1:]), data[2:]


def token_of(version: int, type_name: str, enc: bytes, ciphertext: bytes) -> str:
    data = bytes([1, TYPE_IDS[type_name]]) + enc + ciphertext
    return f"cryptd:v{version}:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def versions(server: Server, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = ok(server.request("GET", f"/v1/keys/{name}"))["versions"]
    return found


def mldsa_public(server: Server, name: str) -> bytes:
    pem = versions(server, name)[-1]["public_key_pem"]
    public = serialization.load_pem_public_key(pem.encode())
    assert isinstance(
        public, mldsa.MLDSA44PublicKey | mldsa.MLDSA65PublicKey | mldsa.MLDSA87PublicKey
    )
    return public.public_bytes_raw()


# ML-DSA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", list(DILITHIUM))
def test_mldsa_signatures_interoperate_both_ways(server: Server, type_name: str) -> None:
    name = f"pq-{type_name}"
    ok(server.request("POST", f"/v1/keys/{name}", {"type": type_name}), 201)
    public = mldsa_public(server, name)
    level = int(type_name.rsplit("-", 1)[1])
    message, context = os.urandom(200), b"invoice:2026"
    signed = ok(
        server.request(
            "POST", f"/v1/sign/{name}", {"message": b64(message), "context": b64(context)}
        )
    )
    signature = unb64(signed["signature"])
    plain = unb64(
        ok(server.request("POST", f"/v1/sign/{name}", {"message": b64(message)}))["signature"]
    )
    dilithium = DILITHIUM[type_name]
    assert dilithium.verify(public, message, signature, ctx=context)
    assert not dilithium.verify(public, message, signature)
    assert dilithium.verify(public, message, plain)
    noble = peer(
        [
            {
                "op": "mldsa_verify",
                "level": level,
                "pk": public.hex(),
                "msg": message.hex(),
                "sig": signature.hex(),
                "ctx": context.hex(),
            },
            {
                "op": "mldsa_verify",
                "level": level,
                "pk": public.hex(),
                "msg": message.hex(),
                "sig": signature.hex(),
                "ctx": "",
            },
        ]
    )
    assert [a["valid"] for a in noble] == [True, False]
    # external mu, computed by dilithium-py (FIPS 204 section 6.2), signed by cryptd: the
    # signature is the message's, with that context, for both peers.
    mu = dilithium.prehash_external_mu(public, message, ctx=context)
    by_mu = ok(
        server.request(
            "POST", f"/v1/sign/{name}", {"message": b64(mu), "message_type": "external_mu"}
        )
    )
    assert dilithium.verify(public, message, unb64(by_mu["signature"]), ctx=context)
    # The other way: signatures by dilithium-py (imported seed) and noble verify in cryptd.
    seed = os.urandom(32)
    imported = f"pq-imported-{type_name}"
    ok(import_key(server, imported, type_name, seed), 201)
    theirs_pk, theirs_sk = dilithium.key_derive(seed)
    assert mldsa_public(server, imported) == theirs_pk
    by_dilithium = dilithium.sign(theirs_sk, message, ctx=context)
    (by_noble,) = peer(
        [
            {
                "op": "mldsa_sign",
                "level": level,
                "seed": seed.hex(),
                "msg": message.hex(),
                "ctx": context.hex(),
            }
        ]
    )
    assert bytes.fromhex(by_noble["pk"]) == theirs_pk
    batch = [
        {"message": b64(message), "context": b64(context), "signature": b64(by_dilithium)},
        {
            "message": b64(message),
            "context": b64(context),
            "signature": b64(bytes.fromhex(by_noble["sig"])),
        },
        {"message": b64(message), "signature": b64(by_dilithium)},  # context missing
        {
            "message": b64(dilithium.prehash_external_mu(theirs_pk, message, ctx=context)),
            "message_type": "external_mu",
            "signature": b64(by_dilithium),
        },
        {"message": b64(message), "context": b64(b"x" * 256), "signature": b64(by_dilithium)},
    ]
    answers = ok(server.request("POST", f"/v1/verify/{imported}", {"batch": batch}))["batch"]
    assert answers[:4] == [{"valid": True}, {"valid": True}, {"valid": False}, {"valid": True}]
    assert answers[4]["error"]["code"] == "invalid_request"


def test_mldsa_bad_requests_are_400(server: Server) -> None:
    ok(server.request("POST", "/v1/keys/pq-bad-dsa", {"type": "ml-dsa-44"}), 201)
    ok(server.request("POST", "/v1/keys/pq-bad-ed", {"type": "ed25519"}), 201)
    mu = b64(bytes(64))
    cases = [
        ("pq-bad-dsa", {"message": b64(b"m"), "context": b64(b"c" * 256)}, "255"),
        ("pq-bad-dsa", {"message": b64(bytes(63)), "message_type": "external_mu"}, "64-byte"),
        ("pq-bad-dsa", {"message": b64(bytes(65)), "message_type": "external_mu"}, "64-byte"),
        ("pq-bad-dsa", {"message": mu, "message_type": "external_mu", "context": ""}, "mu"),
        ("pq-bad-dsa", {"digest": mu}, "messages only"),
        ("pq-bad-dsa", {"message": mu, "algorithm": "pss"}, "algorithm"),
        ("pq-bad-ed", {"message": mu, "message_type": "external_mu"}, "message_type"),
        ("pq-bad-ed", {"message": mu, "context": b64(b"c")}, "context"),
        ("pq-bad-ed", {"message": mu, "message_type": "raw"}, "message_type"),
    ]
    for name, body, text in cases:
        answer = server.request("POST", f"/v1/sign/{name}", body)
        assert_error(answer, 400, "invalid_request")
        assert text in answer.json()["error"]["message"], (body, answer.text)
    answer = server.request("POST", "/v1/sign/pq-bad-dsa", {"message": mu, "message_type": "mu"})
    assert answer.status_code in (400, 422)
    assert ok(server.request("POST", "/v1/sign/pq-bad-dsa", {"message": mu}))["key_version"] == 1


# KEM keys: HPKE ---------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", list(TYPE_IDS))
def test_hpke_tokens_interoperate_with_hpke_js(server: Server, type_name: str) -> None:
    seed = os.urandom(32 if type_name == "x25519-ml-kem-768" else 64)
    name = f"pq-hpke-{type_name}"
    ok(import_key(server, name, type_name, seed), 201)
    (entry,) = versions(server, name)
    public = bytes.fromhex(entry["public_key_raw"])
    if type_name in KYBER:
        spki = serialization.load_pem_public_key(entry["public_key_pem"].encode())
        assert spki.public_bytes_raw() == public  # type: ignore[union-attr]
        assert KYBER[type_name].key_derive(seed)[0] == public
    aad, message = b"order:17", os.urandom(300)
    token = ok(
        server.request("POST", f"/v1/encrypt/{name}", {"plaintext": b64(message), "aad": b64(aad)})
    )["ciphertext"]
    version, body = token_body(token, type_name)
    enc, ciphertext = body[: ENC[type_name]], body[ENC[type_name] :]
    opened, sealed = peer(
        [
            {
                "op": "hpke_open",
                "kem": type_name,
                "sk": seed.hex(),
                "enc": enc.hex(),
                "ct": ciphertext.hex(),
                "aad": aad.hex(),
            },
            {
                "op": "hpke_seal",
                "kem": type_name,
                "pk": public.hex(),
                "pt": message.hex(),
                "aad": aad.hex(),
            },
        ]
    )
    assert bytes.fromhex(opened["pt"]) == message
    theirs = token_of(version, type_name, bytes.fromhex(sealed["enc"]), bytes.fromhex(sealed["ct"]))
    decrypted = ok(
        server.request("POST", f"/v1/decrypt/{name}", {"ciphertext": theirs, "aad": b64(aad)})
    )
    assert unb64(decrypted["plaintext"]) == message
    # Tampered (bit-flipped, truncated) or wrong-aad tokens: one 400 decryption_failed.
    raw = bytes.fromhex(sealed["enc"] + sealed["ct"])
    bad = [
        token_of(version, type_name, raw[:10], b""),
        token_of(version, type_name, raw[:-1], b""),
        token_of(version, type_name, bytes([raw[0] ^ 1]) + raw[1:], b""),
        token_of(version, type_name, raw[:-1] + bytes([raw[-1] ^ 0x80]), b""),
    ]
    items = [{"ciphertext": t, "aad": b64(aad)} for t in bad] + [{"ciphertext": theirs}]
    answers = ok(server.request("POST", f"/v1/decrypt/{name}", {"batch": items}))["batch"]
    assert {json.dumps(a) for a in answers} == {
        json.dumps({"error": {"code": "decryption_failed", "message": "decryption failed"}})
    }


def test_datakey_and_rewrap_to_and_from_kem_keys(server: Server) -> None:
    for name, type_name in (
        ("pq-rw-aes", "aes256-gcm"),
        ("pq-rw-xwing", "x25519-ml-kem-768"),
        ("pq-rw-kem", "ml-kem-1024"),
    ):
        ok(server.request("POST", f"/v1/keys/{name}", {"type": type_name}), 201)
    token = ok(server.request("POST", "/v1/encrypt/pq-rw-aes", {"plaintext": b64(b"secret")}))[
        "ciphertext"
    ]
    to_xwing = ok(
        server.request(
            "POST", "/v1/rewrap/pq-rw-aes", {"ciphertext": token, "to_key": "pq-rw-xwing"}
        )
    )
    to_kem = ok(
        server.request(
            "POST",
            "/v1/rewrap/pq-rw-xwing",
            {"ciphertext": to_xwing["ciphertext"], "to_key": "pq-rw-kem"},
        )
    )
    assert (
        unb64(
            ok(
                server.request(
                    "POST", "/v1/decrypt/pq-rw-kem", {"ciphertext": to_kem["ciphertext"]}
                )
            )["plaintext"]
        )
        == b"secret"
    )
    back = ok(
        server.request(
            "POST",
            "/v1/rewrap/pq-rw-kem",
            {"ciphertext": to_kem["ciphertext"], "to_key": "pq-rw-aes"},
        )
    )
    assert (
        unb64(
            ok(server.request("POST", "/v1/decrypt/pq-rw-aes", {"ciphertext": back["ciphertext"]}))[
                "plaintext"
            ]
        )
        == b"secret"
    )
    made = ok(server.request("POST", "/v1/datakey/pq-rw-xwing", {"bits": 128, "aad": b64(b"a")}))
    opened = ok(
        server.request(
            "POST", "/v1/decrypt/pq-rw-xwing", {"ciphertext": made["ciphertext"], "aad": b64(b"a")}
        )
    )
    assert opened["plaintext"] == made["plaintext"]
    assert len(unb64(made["plaintext"])) == 16


# KEM keys: encapsulate and decapsulate ----------------------------------------------------------


@pytest.mark.parametrize("type_name", list(KYBER))
def test_encapsulation_interoperates_with_kyber_py_and_noble(
    server: Server, type_name: str
) -> None:
    seed = os.urandom(64)
    name = f"pq-kem-{type_name}"
    ok(import_key(server, name, type_name, seed), 201)
    public = bytes.fromhex(versions(server, name)[0]["public_key_raw"])
    kyber = KYBER[type_name]
    level = int(type_name.rsplit("-", 1)[1])
    secret, ciphertext = kyber.encaps(public)
    (noble,) = peer([{"op": "mlkem_encap", "level": level, "pk": public.hex()}])
    batch = [{"ciphertext": b64(ciphertext)}, {"ciphertext": b64(bytes.fromhex(noble["ct"]))}]
    answers = ok(server.request("POST", f"/v1/decapsulate/{name}", {"batch": batch}))["batch"]
    assert [unb64(a["shared_secret"]) for a in answers] == [secret, bytes.fromhex(noble["ss"])]
    made = ok(server.request("POST", f"/v1/encapsulate/{name}", {}))
    assert made["key_version"] == 1
    _, dk = kyber.key_derive(seed)
    assert kyber.decaps(dk, unb64(made["ciphertext"])) == unb64(made["shared_secret"])
    (theirs,) = peer(
        [
            {
                "op": "mlkem_decap",
                "level": level,
                "seed": seed.hex(),
                "ct": unb64(made["ciphertext"]).hex(),
            }
        ]
    )
    assert bytes.fromhex(theirs["ss"]) == unb64(made["shared_secret"])
    # A ciphertext for another key gives another secret (implicit rejection), not an error.
    other_secret, other_ct = kyber.encaps(kyber.keygen()[0])
    rejected = ok(server.request("POST", f"/v1/decapsulate/{name}", {"ciphertext": b64(other_ct)}))
    assert unb64(rejected["shared_secret"]) != other_secret
    for bad in (ciphertext[:-1], ciphertext + b"\x00", b""):
        answer = server.request("POST", f"/v1/decapsulate/{name}", {"ciphertext": b64(bad)})
        assert_error(answer, 400, "invalid_request")
        assert f"{ENC[type_name]} bytes" in answer.json()["error"]["message"]


def test_encapsulation_policy_and_key_types(server: Server) -> None:
    ok(server.request("POST", "/v1/keys/pq-pol-kem", {"type": "ml-kem-768"}), 201)
    ok(server.request("POST", "/v1/keys/pq-pol-xwing", {"type": "x25519-ml-kem-768"}), 201)
    ok(server.request("POST", "/v1/keys/pq-pol-aes", {"type": "aes256-gcm"}), 201)
    allow = [{"keys": "pq-pol-*", "operations": ["encapsulate", "decrypt", "encrypt"]}]
    client, secret = add_client(server, "pq-no-decap", allow, ("/v1/encapsulate/pq-pol-kem", {}))
    made = ok(
        server.request("POST", "/v1/encapsulate/pq-pol-kem", {}, client_id=client, secret=secret)
    )
    refused = server.request(
        "POST",
        "/v1/decapsulate/pq-pol-kem",
        {"ciphertext": made["ciphertext"]},
        client_id=client,
        secret=secret,
    )
    assert_error(refused, 403, "forbidden")
    mine = ok(
        server.request("POST", "/v1/decapsulate/pq-pol-kem", {"ciphertext": made["ciphertext"]})
    )
    assert mine["shared_secret"] == made["shared_secret"]
    for op, body in (("encapsulate", {}), ("decapsulate", {"ciphertext": made["ciphertext"]})):
        assert_error(server.request("POST", f"/v1/{op}/pq-pol-aes", body), 400, "invalid_request")
    # An ML-KEM-768 ciphertext is too short for X-Wing (1,120 bytes): 400.
    wrong = server.request(
        "POST", "/v1/decapsulate/pq-pol-xwing", {"ciphertext": made["ciphertext"]}
    )
    assert_error(wrong, 400, "invalid_request")
    assert_error(
        server.request("POST", "/v1/encapsulate/pq-pol-kem", {"x": 1}), 422, "invalid_request"
    )
    usage = versions(server, "pq-pol-kem")[0]["usage"]["operations"]
    assert usage["encapsulate"] >= 2
    assert usage["decapsulate"] >= 1
    metrics = server.request("GET", "/metrics", sign=False).text
    for operation in ("encapsulate", "decapsulate"):
        labels = f'operation="{operation}",outcome="ok"'
        assert any(
            line.startswith("cryptd_crypto_operations_total{")
            and labels in line
            and 'key_type="ml-kem-768"' in line
            for line in metrics.splitlines()
        ), operation


def test_xwing_encapsulation_interoperates_with_hpke_js(server: Server) -> None:
    """X-Wing encapsulation (cryptd's combiner over pyca's ML-KEM-768 and X25519) against
    @hpke/hybridkem-x-wing's KEM, both ways."""
    seed = os.urandom(32)
    ok(import_key(server, "pq-kem-xwing", "x25519-ml-kem-768", seed), 201)
    public = versions(server, "pq-kem-xwing")[0]["public_key_raw"]
    made = ok(server.request("POST", "/v1/encapsulate/pq-kem-xwing", {}))
    assert len(unb64(made["ciphertext"])) == 1120
    theirs, opened = peer(
        [
            {"op": "kem_encap", "kem": "x25519-ml-kem-768", "pk": public},
            {
                "op": "kem_decap",
                "kem": "x25519-ml-kem-768",
                "sk": seed.hex(),
                "enc": unb64(made["ciphertext"]).hex(),
            },
        ]
    )
    assert bytes.fromhex(opened["ss"]) == unb64(made["shared_secret"])
    body = {"ciphertext": b64(bytes.fromhex(theirs["enc"]))}
    mine = ok(server.request("POST", "/v1/decapsulate/pq-kem-xwing", body))
    assert unb64(mine["shared_secret"]) == bytes.fromhex(theirs["ss"])


@pytest.mark.parametrize(
    ("type_name", "size"),
    [
        ("ml-dsa-65", 31),
        ("ml-dsa-65", 64),
        ("ml-kem-768", 32),
        ("ml-kem-1024", 65),
        ("x25519-ml-kem-768", 64),
        ("x25519-ml-kem-768", 31),
    ],
)
def test_seed_of_the_wrong_size_is_400_and_stores_nothing(
    server: Server, type_name: str, size: int
) -> None:
    name = f"pq-wrong-{type_name}-{size}"
    assert_error(import_key(server, name, type_name, os.urandom(size)), 400, "invalid_request")
    assert_error(server.request("GET", f"/v1/keys/{name}"), 404, "key_not_found")


def test_cli_signs_with_a_context_and_an_external_mu(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    ok(server.request("POST", "/v1/keys/pq-cli", {"type": "ml-dsa-65"}), 201)
    public = mldsa_public(server, "pq-cli")
    cred = ["--credential", str(server.directory / "dev" / "client.json")]

    def call(*args: str) -> tuple[int, Any]:
        status = main(["call", *args, *cred])
        out = capsys.readouterr().out
        return status, json.loads(out) if out.strip() else None

    status, signed = call("sign", "pq-cli", "--data", "hello", "--context", "app:v1")
    assert status == 0
    signature = unb64(signed["signature"])
    assert ML_DSA_65.verify(public, b"hello", signature, ctx=b"app:v1")
    assert (
        call(
            "verify",
            "pq-cli",
            "--data",
            "hello",
            "--context",
            "app:v1",
            "--signature",
            signed["signature"],
        )[0]
        == 0
    )
    assert call("verify", "pq-cli", "--data", "hello", "--signature", signed["signature"]) == (
        1,
        {"valid": False},
    )
    mu = ML_DSA_65.prehash_external_mu(public, b"hello", ctx=b"app:v1")
    mu_file = server.directory / "pq-cli.mu"
    mu_file.write_bytes(mu)
    status, by_mu = call(
        "sign", "pq-cli", "--data-file", str(mu_file), "--message-type", "external_mu"
    )
    assert status == 0
    assert ML_DSA_65.verify(public, b"hello", unb64(by_mu["signature"]), ctx=b"app:v1")
