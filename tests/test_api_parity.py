"""The routes and fields that Vault Transit and AWS KMS users expect, against a real server:
HMAC keys, random bytes, wrapped-only data keys, hash_algorithm, P-384/P-521, derived and
convergent keys; their error model, batches, policies, metrics labels and audit lines."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from service.auth.clients import generate_secret, write_document
from tests.conftest import Server
from tests.test_api import assert_error

pytestmark = pytest.mark.slow  # a live server


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return server.request("POST", path, body)


# HMAC -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "size"), [("hmac-sha256", 32), ("hmac-sha512", 64), ("hmac-sm3", 32)]
)
def test_hmac_and_verify(server: Server, key: str, size: int) -> None:
    message = b64(b"webhook body")
    result = ok(post(server, f"/v1/hmac/{key}", {"message": message}))
    assert set(result) == {"mac", "key_version"}
    assert result["key_version"] == 1
    prefix, version, text = result["mac"].split(":")
    assert (prefix, version) == ("cryptd", "v1")
    assert len(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))) == size
    # Deterministic: the same message gives the same MAC (blind indexes, tokenization).
    assert ok(post(server, f"/v1/hmac/{key}", {"message": message}))["mac"] == result["mac"]
    good = post(server, f"/v1/verify/{key}", {"message": message, "mac": result["mac"]})
    assert ok(good) == {"valid": True}
    bad = post(server, f"/v1/verify/{key}", {"message": b64(b"other"), "mac": result["mac"]})
    assert ok(bad) == {"valid": False}


def test_hmac_batch_and_errors(server: Server) -> None:
    response = post(
        server,
        "/v1/hmac/hmac-sha256",
        {"batch": [{"message": b64(b"a")}, {"message": "%%"}, {"message": b64(b"b"), "x": 1}, {}]},
    )
    results = ok(response)["batch"]
    assert results[0]["mac"].startswith("cryptd:v1:")
    assert [r["error"]["code"] for r in results[1:]] == ["invalid_request"] * 3
    single = ok(post(server, "/v1/hmac/hmac-sha256", {"message": b64(b"a")}))
    assert results[0] == single
    checks = ok(
        post(
            server,
            "/v1/verify/hmac-sha256",
            {
                "batch": [
                    {"message": b64(b"a"), "mac": single["mac"]},
                    {"message": b64(b"b"), "mac": single["mac"]},
                    {"message": b64(b"a"), "mac": "nope"},
                ]
            },
        )
    )["batch"]
    assert checks[:2] == [{"valid": True}, {"valid": False}]
    assert checks[2]["error"]["code"] == "invalid_request"
    assert_error(post(server, "/v1/hmac/aes256-gcm", {"message": ""}), 400, "invalid_request")
    assert_error(post(server, "/v1/hmac/nope", {"message": ""}), 404, "key_not_found")
    assert_error(post(server, "/v1/hmac/hmac-sha256", {}), 422, "invalid_request")
    assert_error(
        post(server, "/v1/sign/hmac-sha256", {"message": b64(b"m")}), 400, "invalid_request"
    )
    assert_error(
        post(server, "/v1/encrypt/hmac-sha256", {"plaintext": b64(b"m")}), 400, "invalid_request"
    )


@pytest.mark.parametrize(
    ("key", "body", "status", "text"),
    [
        ("hmac-sha256", {"message": "", "signature": b64(b"s")}, 400, "verifies a 'mac'"),
        ("hmac-sha256", {"message": "", "mac": "x", "signature": b64(b"s")}, 400, "not both"),
        ("hmac-sha256", {"digest": b64(bytes(32)), "mac": "cryptd:v1:AA"}, 400, "'digest'"),
        ("hmac-sha256", {"message": "", "mac": "cryptd:v1:AA", "algorithm": "pss"}, 400, "MAC"),
        (
            "hmac-sha256",
            {"message": "", "mac": "cryptd:v1:AA", "hash_algorithm": "sha2-256"},
            400,
            "MAC",
        ),
        ("hmac-sha256", {"message": ""}, 422, "signature"),
        ("hmac-sha256", {"mac": "cryptd:v1:AA"}, 422, "message"),
        ("ecdsa-p256", {"message": "", "mac": "cryptd:v1:AA"}, 400, "'mac' applies to HMAC keys"),
        ("hmac-sha256", {"message": "", "mac": "cryptd:v7:AA"}, 404, "no version 7"),
        (
            "hmac-sha256",
            {"message": "", "mac": "cryptd:v1:AA", "key_version": 2},
            400,
            "key_version",
        ),
        ("ecdsa-p256", {"message": "", "signature": "", "context": b64(b"t")}, 400, "derived"),
    ],
)
def test_verify_field_rules(
    server: Server, key: str, body: dict[str, Any], status: int, text: str
) -> None:
    response = post(server, f"/v1/verify/{key}", body)
    code = "key_not_found" if status == 404 else "invalid_request"
    assert_error(response, status, code)
    assert text in response.json()["error"]["message"]


def test_hmac_rotation_through_the_api(server: Server) -> None:
    name = "parity-hmac-rotation"
    assert server.request("POST", f"/v1/keys/{name}", {"type": "hmac-sm3"}).status_code == 201
    first = ok(post(server, f"/v1/hmac/{name}", {"message": b64(b"m")}))["mac"]
    assert ok(server.request("POST", f"/v1/keys/{name}/rotate"))["latest_version"] == 2
    second = ok(post(server, f"/v1/hmac/{name}", {"message": b64(b"m")}))
    assert second["key_version"] == 2
    assert second["mac"].startswith("cryptd:v2:")
    assert ok(post(server, f"/v1/verify/{name}", {"message": b64(b"m"), "mac": first})) == {
        "valid": True
    }
    ok(server.request("PATCH", f"/v1/keys/{name}", {"min_decryption_version": 2}))
    refused = post(server, f"/v1/verify/{name}", {"message": b64(b"m"), "mac": first})
    assert_error(refused, 400, "invalid_request")
    assert "min_decryption_version" in refused.json()["error"]["message"]


# random ---------------------------------------------------------------------------------------


def test_random(server: Server) -> None:
    for size in (1, 32, 65536):
        data = base64.b64decode(ok(post(server, "/v1/random", {"bytes": size}))["random"])
        assert len(data) == size
    a = ok(post(server, "/v1/random", {"bytes": 32}))["random"]
    b = ok(post(server, "/v1/random", {"bytes": 32}))["random"]
    assert a != b
    for bad in (0, -1, 65537, 10**9):
        response = post(server, "/v1/random", {"bytes": bad})
        assert_error(response, 400, "invalid_request")
        assert response.json()["error"]["message"] == "bytes must be between 1 and 65536"
    assert_error(post(server, "/v1/random", {"bytes": "32"}), 400, "invalid_request")
    assert_error(post(server, "/v1/random", {"bytes": 1.5}), 400, "invalid_request")
    assert_error(post(server, "/v1/random", {}), 422, "invalid_request")
    assert_error(post(server, "/v1/random", {"bytes": 8, "format": "hex"}), 422, "invalid_request")
    assert_error(server.request("POST", "/v1/random", raw=b"{"), 400, "invalid_request")
    assert_error(server.request("GET", "/v1/random"), 405, "method_not_allowed")
    assert_error(
        server.request("POST", "/v1/random", {"bytes": 8}, sign=False), 401, "unauthenticated"
    )


# datakey --------------------------------------------------------------------------------------


def test_datakey_without_plaintext_and_batch(server: Server) -> None:
    wrapped = ok(post(server, "/v1/datakey/aes256-gcm", {"plaintext": False, "aad": b64(b"d")}))
    assert set(wrapped) == {"ciphertext", "key_version"}
    opened = ok(
        post(
            server,
            "/v1/decrypt/aes256-gcm",
            {"ciphertext": wrapped["ciphertext"], "aad": b64(b"d")},
        )
    )
    assert len(base64.b64decode(opened["plaintext"])) == 32
    batch = ok(
        post(
            server,
            "/v1/datakey/sm2",
            {"batch": [{}, {"bits": 128, "plaintext": False}, {"bits": 64}, {"plaintext": "no"}]},
        )
    )["batch"]
    assert set(batch[0]) == {"plaintext", "ciphertext", "key_version"}
    assert set(batch[1]) == {"ciphertext", "key_version"}
    assert batch[2]["error"]["message"] == "bits must be 128 or 256"
    assert batch[3]["error"]["code"] == "invalid_request"
    key = ok(post(server, "/v1/decrypt/sm2", {"ciphertext": batch[1]["ciphertext"]}))
    assert len(base64.b64decode(key["plaintext"])) == 16


# hash_algorithm, P-384, P-521 -----------------------------------------------------------------

PYCA = {"sha2-256": hashes.SHA256(), "sha2-384": hashes.SHA384(), "sha2-512": hashes.SHA512()}


def public_key(server: Server, key: str) -> Any:
    pem = ok(server.request("GET", f"/v1/keys/{key}"))["versions"][0]["public_key_pem"]
    return serialization.load_pem_public_key(pem.encode())


@pytest.mark.parametrize(
    ("key", "curve", "default", "scalar"),
    [("ecdsa-p384", ec.SECP384R1, "sha2-384", 48), ("ecdsa-p521", ec.SECP521R1, "sha2-512", 66)],
)
def test_p384_p521_keys(server: Server, key: str, curve: type, default: str, scalar: int) -> None:
    public = public_key(server, key)
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert isinstance(public.curve, curve)
    message = b"signed with the curve's hash"
    der = base64.b64decode(
        ok(post(server, f"/v1/sign/{key}", {"message": b64(message)}))["signature"]
    )
    public.verify(der, message, ec.ECDSA(PYCA[default]))  # independent check
    raw = ok(post(server, f"/v1/sign/{key}", {"message": b64(message), "encoding": "raw"}))
    assert len(base64.b64decode(raw["signature"])) == 2 * scalar
    checked = post(
        server,
        f"/v1/verify/{key}",
        {"message": b64(message), "signature": raw["signature"], "encoding": "raw"},
    )
    assert ok(checked) == {"valid": True}
    digest = hashlib.new(default.replace("sha2-", "sha"), message).digest()
    by_digest = ok(post(server, f"/v1/sign/{key}", {"digest": b64(digest)}))["signature"]
    assert ok(
        post(server, f"/v1/verify/{key}", {"message": b64(message), "signature": by_digest})
    ) == {"valid": True}
    short = post(server, f"/v1/sign/{key}", {"digest": b64(hashlib.sha256(message).digest())})
    assert_error(short, 400, "invalid_request")
    assert f"digest must be {len(digest)} bytes for {default}" in short.json()["error"]["message"]
    sha256 = ok(
        post(
            server,
            f"/v1/sign/{key}",
            {"digest": b64(hashlib.sha256(message).digest()), "hash_algorithm": "sha2-256"},
        )
    )
    public.verify(base64.b64decode(sha256["signature"]), message, ec.ECDSA(hashes.SHA256()))


@pytest.mark.parametrize("hash_name", list(PYCA))
@pytest.mark.parametrize("algorithm", ["pss", "pkcs1v15"])
def test_rsa_hash_algorithm(server: Server, hash_name: str, algorithm: str) -> None:
    public = public_key(server, "rsa-2048")
    assert isinstance(public, rsa.RSAPublicKey)
    chosen = PYCA[hash_name]
    fields = {"algorithm": algorithm, "hash_algorithm": hash_name}
    signature = ok(post(server, "/v1/sign/rsa-2048", {"message": b64(b"m"), **fields}))["signature"]
    pad = (
        padding.PSS(mgf=padding.MGF1(chosen), salt_length=chosen.digest_size)
        if algorithm == "pss"
        else padding.PKCS1v15()
    )
    public.verify(base64.b64decode(signature), b"m", pad, chosen)
    check = {"message": b64(b"m"), "signature": signature, **fields}
    assert ok(post(server, "/v1/verify/rsa-2048", check)) == {"valid": True}
    if hash_name != "sha2-256":
        default = {"message": b64(b"m"), "signature": signature, "algorithm": algorithm}
        assert ok(post(server, "/v1/verify/rsa-2048", default)) == {"valid": False}


@pytest.mark.parametrize(
    ("key", "hash_name", "text"),
    [
        ("ed25519", "sha2-256", "'hash_algorithm' does not apply"),
        ("sm2", "sha2-256", "'hash_algorithm' does not apply"),
        ("rsa-2048", "sha1", "hash_algorithm must be one of"),
        ("ecdsa-p256", "sha3-256", "hash_algorithm must be one of"),
        ("ecdsa-p384", "SHA384", "hash_algorithm must be one of"),
    ],
)
def test_hash_the_key_type_cannot_use_is_400(
    server: Server, key: str, hash_name: str, text: str
) -> None:
    for route, extra in (("sign", {}), ("verify", {"signature": b64(b"s")})):
        response = post(
            server,
            f"/v1/{route}/{key}",
            {"message": b64(b"m"), "hash_algorithm": hash_name, **extra},
        )
        assert_error(response, 400, "invalid_request")
        assert text in response.json()["error"]["message"]


# derived and convergent keys ------------------------------------------------------------------


def create(server: Server, name: str, body: dict[str, Any]) -> httpx.Response:
    return server.request("POST", f"/v1/keys/{name}", body)


def test_derived_and_convergent_keys(server: Server) -> None:
    created = create(server, "parity-derived", {"type": "aes256-gcm", "derived": True})
    assert created.status_code == 201, created.text
    assert (created.json()["derived"], created.json()["convergent"]) == (True, False)
    convergent = create(
        server, "parity-convergent", {"type": "sm4-gcm", "derived": True, "convergent": True}
    )
    assert convergent.status_code == 201, convergent.text
    described = ok(server.request("GET", "/v1/keys/parity-convergent"))
    assert (described["derived"], described["convergent"]) == (True, True)
    tenant = b64(b"tenant-1")
    enc = ok(
        post(server, "/v1/encrypt/parity-derived", {"plaintext": b64(b"x"), "context": tenant})
    )
    dec = post(
        server, "/v1/decrypt/parity-derived", {"ciphertext": enc["ciphertext"], "context": tenant}
    )
    assert ok(dec)["plaintext"] == b64(b"x")
    other = post(
        server,
        "/v1/decrypt/parity-derived",
        {"ciphertext": enc["ciphertext"], "context": b64(b"tenant-2")},
    )
    assert_error(other, 400, "decryption_failed")
    missing = post(server, "/v1/encrypt/parity-derived", {"plaintext": b64(b"x")})
    assert_error(missing, 400, "invalid_request")
    assert "needs a 'context'" in missing.json()["error"]["message"]
    stray = post(server, "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"x"), "context": tenant})
    assert_error(stray, 400, "invalid_request")
    assert "derived keys only" in stray.json()["error"]["message"]
    assert_error(
        post(server, "/v1/encrypt/parity-derived", {"plaintext": b64(b"x"), "context": "%%"}),
        400,
        "invalid_request",
    )
    items = [{"plaintext": b64(b"4111111111111111"), "context": b64(b"cards")}] * 3
    tokens = ok(post(server, "/v1/encrypt/parity-convergent", {"batch": items}))["batch"]
    assert len({t["ciphertext"] for t in tokens}) == 1
    single = ok(post(server, "/v1/encrypt/parity-convergent", items[0]))
    assert single["ciphertext"] == tokens[0]["ciphertext"]
    wrapped = post(server, "/v1/datakey/parity-derived", {"plaintext": False, "context": tenant})
    assert set(ok(wrapped)) == {"ciphertext", "key_version"}
    moved = ok(
        post(
            server,
            "/v1/rewrap/parity-derived",
            {"ciphertext": enc["ciphertext"], "context": tenant, "to_key": "parity-convergent"},
        )
    )
    opened = post(
        server,
        "/v1/decrypt/parity-convergent",
        {"ciphertext": moved["ciphertext"], "context": tenant},
    )
    assert ok(opened)["plaintext"] == b64(b"x")


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"type": "rsa-2048", "derived": True}, "cannot be derived"),
        ({"type": "ed25519", "derived": True}, "cannot be derived"),
        ({"type": "aes256-gcm", "convergent": True}, "needs 'derived'"),
        ({"type": "hmac-sha256", "derived": True, "convergent": True}, "cannot be convergent"),
    ],
)
def test_flags_the_type_cannot_have(server: Server, body: dict[str, Any], text: str) -> None:
    response = create(server, "parity-bad-flags", body)
    assert_error(response, 400, "invalid_request")
    assert text in response.json()["error"]["message"]
    assert_error(server.request("GET", "/v1/keys/parity-bad-flags"), 404, "key_not_found")
    assert_error(
        create(server, "parity-bad-flags", {"type": "aes256-gcm", "derived": "yes"}),
        400,
        "invalid_request",
    )


# policies, metrics, audit ---------------------------------------------------------------------


def add_client(
    server: Server, client_id: str, allow: list[dict[str, Any]], probe: tuple[str, Any]
) -> tuple[str, bytes]:
    """Add a client to the running server's clients file (it reloads the file when it changes)
    and wait until ``probe`` (path, body), a request the client may make, answers 200."""
    path = server.directory / "dev" / "clients.json"
    document = json.loads(path.read_text())
    secret = generate_secret()
    document["clients"][client_id] = {"secret": secret, "allow": allow}
    write_document(path, document)
    raw = base64.b64decode(secret)
    deadline = time.monotonic() + 15
    while True:
        answer = server.request("POST", *probe, client_id=client_id, secret=raw)
        if answer.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert answer.status_code == 200, answer.text
    return client_id, raw


@pytest.fixture(scope="module")
def limited(server: Server) -> tuple[str, bytes]:
    """A client that may only hmac keys named hmac-*."""
    allow = [{"keys": "hmac-*", "operations": ["hmac"]}]
    return add_client(server, "parity-limited", allow, ("/v1/hmac/hmac-sha256", {"message": ""}))


def test_policies_for_the_new_operations(server: Server, limited: tuple[str, bytes]) -> None:
    client_id, secret = limited

    def call(path: str, body: dict[str, Any]) -> httpx.Response:
        return server.request("POST", path, body, client_id=client_id, secret=secret)

    assert call("/v1/hmac/hmac-sm3", {"message": ""}).status_code == 200
    assert_error(call("/v1/hmac/parity-hmac-rotation", {"message": ""}), 403, "forbidden")
    assert_error(
        call("/v1/verify/hmac-sha256", {"message": "", "mac": "cryptd:v1:AA"}), 403, "forbidden"
    )
    assert_error(call("/v1/random", {"bytes": 8}), 403, "forbidden")
    assert_error(call("/v1/datakey/aes256-gcm", {"plaintext": False}), 403, "forbidden")
    assert_error(call("/v1/keys/parity-x", {"type": "hmac-sha256"}), 403, "forbidden")


def test_metrics_label_the_new_operations(server: Server) -> None:
    ok(post(server, "/v1/hmac/hmac-sha512", {"message": b64(b"m")}))
    ok(post(server, "/v1/random", {"bytes": 4}))
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'operation="hmac"' in text
    assert 'key_type="hmac-sha512"' in text
    assert 'route="/v1/hmac/{key}"' in text
    assert 'route="/v1/random"' in text


def test_hmac_is_audited_without_the_message(server: Server) -> None:
    marker = b"parity-audit-marker-2b7e"
    ok(post(server, "/v1/hmac/hmac-sha256", {"message": b64(marker)}))
    deadline = time.monotonic() + 10
    while True:
        audit = [
            json.loads(line)
            for line in server.log().splitlines()
            if line.startswith("{") and '"cryptd.audit"' in line
        ]
        if any(a["event"] == "hmac" and a["key"] == "hmac-sha256" for a in audit):
            break
        assert time.monotonic() < deadline, "no audit line for hmac"
        time.sleep(0.2)
    line = next(a for a in audit if a["event"] == "hmac" and a["key"] == "hmac-sha256")
    assert line["outcome"] == "ok"
    assert line["key_version"] == 1
    assert marker.decode() not in server.log()
    assert b64(marker) not in server.log()
