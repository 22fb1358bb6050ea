"""The v1 API against a real uvicorn process: every route and every row of the error table."""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import time

import httpx
import pytest

from tests.conftest import Server

pytestmark = pytest.mark.slow  # a live server

ALL_TYPES = (
    "aes256-gcm",
    "sm4-gcm",
    "rsa-2048",
    "rsa-3072",
    "rsa-4096",
    "ecdsa-p256",
    "ed25519",
    "sm2",
)
ENCRYPTING = ("aes256-gcm", "sm4-gcm", "rsa-2048", "rsa-3072", "rsa-4096", "sm2")
SIGNING = ("rsa-2048", "rsa-3072", "rsa-4096", "ecdsa-p256", "ed25519", "sm2")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code
    assert response.headers["content-type"] == "application/json"
    assert "Traceback" not in response.text


# --- crypto operations -------------------------------------------------------------------


@pytest.mark.parametrize("key", ENCRYPTING)
def test_encrypt_decrypt_round_trip_with_aad(server: Server, key: str) -> None:
    plaintext = b"\x00secret payload\xff" * 10
    enc = server.request(
        "POST", f"/v1/encrypt/{key}", {"plaintext": b64(plaintext), "aad": b64(b"ctx")}
    )
    assert enc.status_code == 200, enc.text
    body = enc.json()
    assert body["key_version"] == 1
    assert body["ciphertext"].startswith("cryptd:v1:")
    dec = server.request(
        "POST", f"/v1/decrypt/{key}", {"ciphertext": body["ciphertext"], "aad": b64(b"ctx")}
    )
    assert dec.status_code == 200, dec.text
    assert dec.json() == {"plaintext": b64(plaintext), "key_version": 1}
    wrong_aad = server.request(
        "POST", f"/v1/decrypt/{key}", {"ciphertext": body["ciphertext"], "aad": b64(b"other")}
    )
    assert_error(wrong_aad, 400, "decryption_failed")


@pytest.mark.parametrize("key", ENCRYPTING)
def test_empty_plaintext(server: Server, key: str) -> None:
    enc = server.request("POST", f"/v1/encrypt/{key}", {"plaintext": ""})
    assert enc.status_code == 200, enc.text
    dec = server.request("POST", f"/v1/decrypt/{key}", {"ciphertext": enc.json()["ciphertext"]})
    assert dec.json()["plaintext"] == ""


def test_token_never_decrypts_under_another_key(server: Server) -> None:
    for source in ENCRYPTING:
        token = server.request("POST", f"/v1/encrypt/{source}", {"plaintext": b64(b"x")}).json()[
            "ciphertext"
        ]
        for other in ENCRYPTING:
            if other == source:
                continue
            response = server.request("POST", f"/v1/decrypt/{other}", {"ciphertext": token})
            assert_error(response, 400, "decryption_failed")


def test_tampered_token_is_decryption_failed(server: Server) -> None:
    token = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"hello")}).json()[
        "ciphertext"
    ]
    prefix, data = token.rsplit(":", 1)
    raw = bytearray(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    messages = set()
    for index in range(len(raw)):
        raw[index] ^= 0x01
        forged = prefix + ":" + base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
        raw[index] ^= 0x01
        response = server.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": forged})
        assert_error(response, 400, "decryption_failed")
        messages.add(response.json()["error"]["message"])
    assert len(messages) == 1  # no oracle: every failure reads the same


@pytest.mark.parametrize("key", SIGNING)
def test_sign_verify(server: Server, key: str) -> None:
    message = b64(b"the message")
    sig = server.request("POST", f"/v1/sign/{key}", {"message": message})
    assert sig.status_code == 200, sig.text
    signature = sig.json()["signature"]
    assert sig.json()["key_version"] == 1
    ok = server.request("POST", f"/v1/verify/{key}", {"message": message, "signature": signature})
    assert ok.json() == {"valid": True}
    bad = server.request(
        "POST", f"/v1/verify/{key}", {"message": b64(b"another"), "signature": signature}
    )
    assert bad.json() == {"valid": False}
    for garbage in (b"", b"\x30\x03\x02\x01", b"\x00" * 600):
        response = server.request(
            "POST", f"/v1/verify/{key}", {"message": message, "signature": b64(garbage)}
        )
        assert response.status_code == 200
        assert response.json() == {"valid": False}


def test_signature_of_another_key_is_invalid_not_error(server: Server) -> None:
    message = b64(b"m")
    signature = server.request("POST", "/v1/sign/rsa-2048", {"message": message}).json()[
        "signature"
    ]
    response = server.request(
        "POST", "/v1/verify/rsa-3072", {"message": message, "signature": signature}
    )
    assert response.json() == {"valid": False}


@pytest.mark.parametrize("key", ["rsa-2048", "ecdsa-p256"])
def test_sign_digest_matches_message(server: Server, key: str) -> None:
    message = b"digest me"
    digest = b64(hashlib.sha256(message).digest())
    signature = server.request("POST", f"/v1/sign/{key}", {"digest": digest}).json()["signature"]
    response = server.request(
        "POST", f"/v1/verify/{key}", {"message": b64(message), "signature": signature}
    )
    assert response.json() == {"valid": True}


def test_rsa_algorithms_and_ecdsa_encodings(server: Server) -> None:
    message = b64(b"m")
    for algorithm in ("pss", "pkcs1v15"):
        sig = server.request(
            "POST", "/v1/sign/rsa-2048", {"message": message, "algorithm": algorithm}
        ).json()["signature"]
        same = server.request(
            "POST",
            "/v1/verify/rsa-2048",
            {"message": message, "signature": sig, "algorithm": algorithm},
        )
        assert same.json() == {"valid": True}
    raw = server.request("POST", "/v1/sign/ecdsa-p256", {"message": message, "encoding": "raw"})
    assert len(base64.b64decode(raw.json()["signature"])) == 64
    check = server.request(
        "POST",
        "/v1/verify/ecdsa-p256",
        {"message": message, "signature": raw.json()["signature"], "encoding": "raw"},
    )
    assert check.json() == {"valid": True}


@pytest.mark.parametrize(
    ("key", "extra"),
    [
        ("rsa-2048", {"signer_id": "x"}),
        ("rsa-2048", {"encoding": "raw"}),
        ("rsa-2048", {"algorithm": "md5"}),
        ("ecdsa-p256", {"algorithm": "pss"}),
        ("ed25519", {"encoding": "raw"}),
        ("ed25519", {"signer_id": "x"}),
        ("sm2", {"algorithm": "pss"}),
    ],
)
def test_options_for_the_wrong_key_type_are_400(
    server: Server, key: str, extra: dict[str, str]
) -> None:
    response = server.request("POST", f"/v1/sign/{key}", {"message": b64(b"m"), **extra})
    assert_error(response, 400, "invalid_request")


def test_message_and_digest_exclusive(server: Server) -> None:
    both = server.request(
        "POST", "/v1/sign/rsa-2048", {"message": b64(b"m"), "digest": b64(b"\x00" * 32)}
    )
    assert_error(both, 400, "invalid_request")
    neither = server.request("POST", "/v1/sign/rsa-2048", {})
    assert_error(neither, 400, "invalid_request")
    ed_digest = server.request("POST", "/v1/sign/ed25519", {"digest": b64(b"\x00" * 32)})
    assert_error(ed_digest, 400, "invalid_request")
    short_digest = server.request("POST", "/v1/sign/rsa-2048", {"digest": b64(b"\x00" * 31)})
    assert_error(short_digest, 400, "invalid_request")


def test_operation_the_key_type_does_not_support(server: Server) -> None:
    assert_error(
        server.request("POST", "/v1/sign/aes256-gcm", {"message": b64(b"m")}),
        400,
        "invalid_request",
    )
    assert_error(
        server.request("POST", "/v1/encrypt/ed25519", {"plaintext": b64(b"m")}),
        400,
        "invalid_request",
    )
    assert_error(server.request("POST", "/v1/datakey/ecdsa-p256", {}), 400, "invalid_request")


def test_external_rsa_oaep_ciphertext(server: Server) -> None:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

    described = server.request("GET", "/v1/keys/rsa-2048").json()
    public = serialization.load_pem_public_key(described["versions"][0]["public_key_pem"].encode())
    ciphertext = public.encrypt(  # type: ignore[union-attr]
        b"from outside",
        padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None),
    )
    response = server.request(
        "POST",
        "/v1/decrypt/rsa-2048",
        {"ciphertext": b64(ciphertext), "format": "rsa-oaep-sha256"},
    )
    assert response.json() == {"plaintext": b64(b"from outside"), "key_version": 1}
    tampered = bytearray(ciphertext)
    tampered[10] ^= 1
    assert_error(
        server.request(
            "POST",
            "/v1/decrypt/rsa-2048",
            {"ciphertext": b64(bytes(tampered)), "format": "rsa-oaep-sha256"},
        ),
        400,
        "decryption_failed",
    )
    assert_error(
        server.request(
            "POST", "/v1/decrypt/rsa-2048", {"ciphertext": b64(ciphertext), "format": "sm2"}
        ),
        400,
        "invalid_request",
    )


# --- rewrap, datakey, batch --------------------------------------------------------------


def test_rewrap_and_to_key_migration(server: Server) -> None:
    token = server.request(
        "POST", "/v1/encrypt/rsa-2048", {"plaintext": b64(b"migrate me"), "aad": b64(b"a")}
    ).json()["ciphertext"]
    same = server.request("POST", "/v1/rewrap/rsa-2048", {"ciphertext": token, "aad": b64(b"a")})
    assert same.status_code == 200, same.text
    assert "plaintext" not in same.json()
    moved = server.request(
        "POST", "/v1/rewrap/rsa-2048", {"ciphertext": token, "aad": b64(b"a"), "to_key": "sm2"}
    )
    assert moved.status_code == 200, moved.text
    out = server.request(
        "POST", "/v1/decrypt/sm2", {"ciphertext": moved.json()["ciphertext"], "aad": b64(b"a")}
    )
    assert out.json()["plaintext"] == b64(b"migrate me")
    assert_error(
        server.request("POST", "/v1/rewrap/rsa-2048", {"ciphertext": token, "to_key": "nope"}),
        404,
        "key_not_found",
    )
    assert_error(
        server.request("POST", "/v1/rewrap/rsa-2048", {"ciphertext": token, "to_key": "ed25519"}),
        400,
        "invalid_request",
    )


@pytest.mark.parametrize("bits", [128, 256])
def test_datakey(server: Server, bits: int) -> None:
    response = server.request("POST", "/v1/datakey/aes256-gcm", {"bits": bits, "aad": b64(b"d")})
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(base64.b64decode(body["plaintext"])) == bits // 8
    dec = server.request(
        "POST", "/v1/decrypt/aes256-gcm", {"ciphertext": body["ciphertext"], "aad": b64(b"d")}
    )
    assert dec.json()["plaintext"] == body["plaintext"]
    assert_error(
        server.request("POST", "/v1/datakey/aes256-gcm", {"bits": 192}), 400, "invalid_request"
    )


def test_datakey_defaults_to_256_bits(server: Server) -> None:
    body = server.request("POST", "/v1/datakey/sm2", {}).json()
    assert len(base64.b64decode(body["plaintext"])) == 32


def test_batch_mixed_good_and_bad_items(server: Server) -> None:
    good = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"one")}).json()
    response = server.request(
        "POST",
        "/v1/decrypt/aes256-gcm",
        {
            "batch": [
                {"ciphertext": good["ciphertext"]},
                {"ciphertext": good["ciphertext"][:-4] + "AAAA"},
                {"ciphertext": "not a token"},
                {"ciphertext": 5},
                {"nothing": True},
                "not an object",
                {"ciphertext": good["ciphertext"], "aad": "%%%"},
            ]
        },
    )
    assert response.status_code == 200, response.text
    results = response.json()["batch"]
    assert len(results) == 7
    assert results[0] == {"plaintext": b64(b"one"), "key_version": 1}
    codes = [r["error"]["code"] for r in results[1:]]
    assert codes == ["decryption_failed"] + ["invalid_request"] * 5


@pytest.mark.parametrize("op", ["encrypt", "sign"])
def test_batch_order_and_single_path(server: Server, op: str) -> None:
    key = "rsa-2048"
    field = "plaintext" if op == "encrypt" else "message"
    items = [{field: b64(f"item {i}".encode())} for i in range(150)]  # spans several chunks
    response = server.request("POST", f"/v1/{op}/{key}", {"batch": items})
    results = response.json()["batch"]
    assert len(results) == 150
    if op == "encrypt":
        tokens = [{"ciphertext": r["ciphertext"]} for r in results]
        back = server.request("POST", f"/v1/decrypt/{key}", {"batch": tokens}).json()["batch"]
        assert [base64.b64decode(r["plaintext"]) for r in back] == [
            f"item {i}".encode() for i in range(150)
        ]
    else:
        checks = [
            {"message": item["message"], "signature": r["signature"]}
            for item, r in zip(items, results, strict=True)
        ]
        verified = server.request("POST", f"/v1/verify/{key}", {"batch": checks}).json()["batch"]
        assert all(v == {"valid": True} for v in verified)


def test_batch_shape_errors(server: Server) -> None:
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"batch": []}), 400, "invalid_request"
    )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"batch": {"plaintext": ""}}),
        400,
        "invalid_request",
    )
    too_many = {"batch": [{"plaintext": ""}] * 1001}
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", too_many), 413, "payload_too_large"
    )
    unknown = server.request("POST", "/v1/encrypt/nope", {"batch": [{"plaintext": ""}]})
    assert_error(unknown, 404, "key_not_found")


# --- keys -------------------------------------------------------------------------------


def test_list_and_describe_keys(server: Server) -> None:
    listed = server.request("GET", "/v1/keys").json()["keys"]
    names = {k["name"] for k in listed}
    assert set(ALL_TYPES) <= names
    for entry in listed:
        assert set(entry) == {
            "name",
            "type",
            "latest_version",
            "min_decryption_version",
            "min_encryption_version",
            "state",
        }
    for key in ALL_TYPES:
        described = server.request("GET", f"/v1/keys/{key}").json()
        assert described["type"] == key
        assert described["deletion_allowed"] in (True, False)
        version = described["versions"][0]
        assert version["created_at"].endswith("Z")
        time.strptime(version["created_at"], "%Y-%m-%dT%H:%M:%SZ")
        text = str(described)
        assert "PRIVATE" not in text
        if key in ("aes256-gcm", "sm4-gcm"):
            assert "public_key_pem" not in version
        else:
            assert version["public_key_pem"].startswith("-----BEGIN PUBLIC KEY-----")


def test_key_lifecycle_rotation_and_min_version(server: Server) -> None:
    name = "lifecycle-test"
    created = server.request("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"})
    assert created.status_code == 201, created.text
    assert created.json()["latest_version"] == 1
    assert created.json()["deletion_allowed"] is False
    assert_error(
        server.request("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"}), 409, "conflict"
    )
    old = server.request("POST", f"/v1/encrypt/{name}", {"plaintext": b64(b"v1")}).json()
    rotated = server.request("POST", f"/v1/keys/{name}/rotate")
    assert rotated.status_code == 200
    assert rotated.json()["latest_version"] == 2
    new = server.request("POST", f"/v1/encrypt/{name}", {"plaintext": b64(b"v2")}).json()
    assert new["key_version"] == 2
    assert new["ciphertext"].startswith("cryptd:v2:")
    pinned = server.request(
        "POST", f"/v1/encrypt/{name}", {"plaintext": b64(b"x"), "key_version": 1}
    ).json()
    assert pinned["key_version"] == 1
    assert server.request("POST", f"/v1/decrypt/{name}", {"ciphertext": old["ciphertext"]}).json()[
        "plaintext"
    ] == b64(b"v1")
    raised = server.request("PATCH", f"/v1/keys/{name}", {"min_decryption_version": 2})
    assert raised.json()["min_decryption_version"] == 2
    assert_error(
        server.request("POST", f"/v1/decrypt/{name}", {"ciphertext": old["ciphertext"]}),
        400,
        "invalid_request",
    )
    assert_error(
        server.request("POST", f"/v1/encrypt/{name}", {"plaintext": "", "key_version": 3}),
        404,
        "key_not_found",
    )
    assert_error(
        server.request("POST", f"/v1/encrypt/{name}", {"plaintext": "", "key_version": 0}),
        400,
        "invalid_request",
    )
    assert_error(
        server.request("PATCH", f"/v1/keys/{name}", {"unknown": 1}), 400, "invalid_request"
    )
    assert_error(
        server.request("PATCH", f"/v1/keys/{name}", {"min_decryption_version": 3}),
        400,
        "invalid_request",
    )
    assert_error(server.request("DELETE", f"/v1/keys/{name}"), 409, "conflict")
    server.request("PATCH", f"/v1/keys/{name}", {"deletion_allowed": True})
    deleted = server.request("DELETE", f"/v1/keys/{name}")
    assert deleted.status_code == 204
    assert_error(server.request("GET", f"/v1/keys/{name}"), 404, "key_not_found")
    again = server.request("POST", f"/v1/keys/{name}", {"type": "sm2"})
    assert again.status_code == 201
    assert again.json()["latest_version"] == 1
    # the old key's v1 token never opens under the new key that reuses the name
    assert_error(
        server.request("POST", f"/v1/decrypt/{name}", {"ciphertext": pinned["ciphertext"]}),
        400,
        "decryption_failed",
    )
    assert_error(
        server.request("POST", f"/v1/decrypt/{name}", {"ciphertext": new["ciphertext"]}),
        404,
        "key_not_found",
    )


def test_rotate_and_delete_unknown_key(server: Server) -> None:
    assert_error(server.request("POST", "/v1/keys/ghost/rotate"), 404, "key_not_found")
    assert_error(server.request("DELETE", "/v1/keys/ghost"), 404, "key_not_found")
    assert_error(
        server.request("PATCH", "/v1/keys/ghost", {"deletion_allowed": True}), 404, "key_not_found"
    )
    assert_error(server.request("POST", "/v1/keys/ghost", {"type": "des"}), 400, "invalid_request")


# --- the error table ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/encrypt/%2E%2E",
        "/v1/encrypt/bad%20name",
        "/v1/encrypt/" + "a" * 129,
        "/v1/keys/bad$name",
        "/v1/decrypt/x%3Fy",
    ],
)
def test_invalid_key_names_are_400(server: Server, path: str) -> None:
    response = server.request("POST", path, {"plaintext": ""})
    assert_error(response, 400, "invalid_request")


def test_malformed_json_and_wrong_types(server: Server) -> None:
    for raw in (b"{", b"[1,2]", b"null", b"\xff\xfe", b""):
        assert_error(
            server.request("POST", "/v1/encrypt/aes256-gcm", raw=raw), 400, "invalid_request"
        )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": 5}), 400, "invalid_request"
    )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": "not base64!"}),
        400,
        "invalid_request",
    )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": "YQ"}),  # unpadded
        400,
        "invalid_request",
    )
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": "", "key_version": "1"}),
        400,
        "invalid_request",
    )


def test_schema_validation_is_422(server: Server) -> None:
    assert_error(server.request("POST", "/v1/encrypt/aes256-gcm", {}), 422, "invalid_request")
    assert_error(
        server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": "", "extra": 1}),
        422,
        "invalid_request",
    )
    assert_error(
        server.request("POST", "/v1/verify/rsa-2048", {"message": ""}), 422, "invalid_request"
    )


def test_verify_bad_base64_signature_is_an_error(server: Server) -> None:
    response = server.request(
        "POST", "/v1/verify/ed25519", {"message": b64(b"m"), "signature": "@@@"}
    )
    assert_error(response, 400, "invalid_request")


def test_unauthenticated(server: Server) -> None:
    response = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}, sign=False)
    assert_error(response, 401, "unauthenticated")
    wrong = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}, secret=b"\x01" * 32)
    assert_error(wrong, 401, "unauthenticated")
    assert wrong.json() == response.json()


def test_unknown_route_and_wrong_method(server: Server) -> None:
    assert_error(server.request("GET", "/v2/nothing"), 404, "not_found")
    assert_error(server.request("POST", "/v1/nothing/here", {}), 404, "not_found")
    wrong = server.request("GET", "/v1/encrypt/aes256-gcm")
    assert_error(wrong, 405, "method_not_allowed")
    assert "POST" in wrong.headers["allow"]
    assert_error(server.request("PUT", "/v1/keys/aes256-gcm", {}), 405, "method_not_allowed")


def test_body_over_the_limit_is_413(server: Server) -> None:
    big = {"plaintext": b64(b"\x00" * (1024 * 1024))}
    assert_error(server.request("POST", "/v1/encrypt/aes256-gcm", big), 413, "payload_too_large")
    # the service keeps serving
    ok = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"after")})
    assert ok.status_code == 200


def test_request_id_is_echoed_or_made(server: Server) -> None:
    echoed = server.request("GET", "/healthz", headers={"X-Request-ID": "abc-123"})
    assert echoed.headers["x-request-id"] == "abc-123"
    made = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}, sign=False)
    assert len(made.headers["x-request-id"]) >= 16
    hostile = server.request("GET", "/healthz", headers={"X-Request-ID": "x" * 500})
    assert hostile.headers["x-request-id"] != "x" * 500


def test_health_and_readiness(server: Server) -> None:
    assert server.request("GET", "/healthz", sign=False).json() == {"status": "ok"}
    ready = server.request("GET", "/readyz", sign=False)
    assert ready.status_code == 200
    body = ready.json()
    assert body["status"] == "ready"
    assert {"keyring", "pool", "replay_store"} <= set(body["checks"])


def test_concurrent_requests_all_succeed(server: Server) -> None:
    def one(i: int) -> int:
        key = ENCRYPTING[i % len(ENCRYPTING)]
        return server.request("POST", f"/v1/encrypt/{key}", {"plaintext": b64(b"c")}).status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(96)))
    assert statuses == [200] * 96


def test_no_secret_in_server_log(server: Server) -> None:
    marker = b"plaintext-marker-7f3a9c"
    server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(marker)})
    server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(marker)}, sign=False)
    server.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": "cryptd:v1:AAAA"})
    # The first start prints the development credential once, before the server starts.
    log = server.log().split("Started server process", 1)[1]
    assert marker.decode() not in log
    assert b64(marker) not in log
    assert base64.b64encode(server.secret).decode() not in log
    assert "Traceback" not in log
    assert "PRIVATE KEY" not in log
