"""Wrapped key import against a real server, by an outside client.

The client side of these tests uses Python's `cryptography` and nothing of cryptd: it follows
OpenBao's documented BYOK procedure (docs "Key wrapping for transit key import": read the
wrapping key; make an ephemeral AES-256 key; wrap the target key with it, AES key wrap with
padding; encrypt the ephemeral key with the wrapping key, RSA-OAEP SHA-256; send the two
concatenated, base64) and then checks cryptd's answers with its own copy of the key: HMACs equal
Python's `hmac`, tokens it decrypts itself from docs/FORMAT.md, signatures it verifies.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import struct
import time
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import hashes, keywrap, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tests.conftest import Server
from tests.test_api import assert_error
from tests.test_api_parity import add_client

pytestmark = pytest.mark.slow  # a live server

OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


# The outside client ---------------------------------------------------------------------------


def wrapping_public_key(server: Server) -> rsa.RSAPublicKey:
    body = ok(server.request("GET", "/v1/keys/wrapping-key"))
    assert body["type"] == "rsa-4096"
    public = serialization.load_pem_public_key(body["public_key"].encode())
    assert isinstance(public, rsa.RSAPublicKey)
    assert public.key_size == 4096
    return public


def byok_wrap(public: rsa.RSAPublicKey, target_key: bytes) -> str:
    """OpenBao's procedure, step by step."""
    ephemeral = os.urandom(32)
    wrapped_target = keywrap.aes_key_wrap_with_padding(ephemeral, target_key)
    wrapped_ephemeral = public.encrypt(ephemeral, OAEP)
    return base64.b64encode(wrapped_ephemeral + wrapped_target).decode()


def pkcs8(key: Any) -> bytes:
    der: bytes = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return der


def token_ad(name: str, version: int, type_id: int, aad: bytes) -> bytes:
    encoded = name.encode()
    return b"cryptd/1" + struct.pack(">BBI", type_id, len(encoded), version) + encoded + aad


def token_data(token: str) -> tuple[int, bytes]:
    _, version, text = token.split(":")
    return int(version[1:]), base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mac_tag(mac: str) -> bytes:
    text = mac.split(":")[2]
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def import_key(
    server: Server, name: str, type_name: str, material: bytes, **extra: Any
) -> httpx.Response:
    ciphertext = byok_wrap(wrapping_public_key(server), material)
    return server.request(
        "POST", f"/v1/keys/{name}/import", {"type": type_name, "ciphertext": ciphertext, **extra}
    )


@pytest.fixture(scope="module")
def limited_client(server: Server) -> tuple[str, bytes]:
    """A client with every operation on every key, but not admin."""
    allow = [{"keys": "*", "operations": ["*"]}]
    return add_client(server, "byok-not-admin", allow, ("/v1/random", {"bytes": 1}))


# Tests ----------------------------------------------------------------------------------------


def test_wrapping_key_is_stable_and_admin_only(server: Server) -> None:
    first = wrapping_public_key(server)
    second = wrapping_public_key(server)
    assert first.public_numbers() == second.public_numbers()
    listed = [k["name"] for k in ok(server.request("GET", "/v1/keys"))["keys"]]
    assert not any(name.startswith("cryptd:") for name in listed)  # internal, never listed
    for path in ("/v1/encrypt/cryptd:wrapping-key", "/v1/decrypt/cryptd%3Awrapping-key"):
        assert_error(server.request("POST", path, {"ciphertext": "x"}), 400, "invalid_request")


@pytest.mark.parametrize("type_name", ["hmac-sha256", "hmac-sha512", "hmac-sm3"])
def test_imported_hmac_key_gives_pythons_hmac(server: Server, type_name: str) -> None:
    target = os.urandom(48)
    name = f"byok-{type_name}"
    created = ok(import_key(server, name, type_name, target), 201)
    assert (created["name"], created["type"], created["latest_version"]) == (name, type_name, 1)
    digest = {"hmac-sha256": hashlib.sha256, "hmac-sha512": hashlib.sha512}.get(type_name)
    for message in (b"", b"webhook payload", os.urandom(5000)):
        mac = ok(server.request("POST", f"/v1/hmac/{name}", {"message": b64(message)}))["mac"]
        if digest is not None:
            expected = hmac.new(target, message, digest).digest()
        else:  # hashlib has no SM3 on every build: pyca/cryptography's HMAC-SM3 is the reference
            from cryptography.hazmat.primitives import hmac as pyca_hmac

            context = pyca_hmac.HMAC(target, hashes.SM3())
            context.update(message)
            expected = context.finalize()
        assert mac_tag(mac) == expected
        assert mac.startswith("cryptd:v1:")
        # A MAC the client computed itself verifies.
        text = "cryptd:v1:" + base64.urlsafe_b64encode(expected).rstrip(b"=").decode()
        check = {"message": b64(message), "mac": text}
        assert ok(server.request("POST", f"/v1/verify/{name}", check)) == {"valid": True}
    # import-version: a second outside key becomes version 2; version 1 still answers.
    newer = os.urandom(32)
    ciphertext = byok_wrap(wrapping_public_key(server), newer)
    rotated = ok(
        server.request("POST", f"/v1/keys/{name}/import-version", {"ciphertext": ciphertext})
    )
    assert rotated["latest_version"] == 2
    mac = ok(server.request("POST", f"/v1/hmac/{name}", {"message": b64(b"m")}))
    assert mac["key_version"] == 2
    if digest is not None:
        assert mac_tag(mac["mac"]) == hmac.new(newer, b"m", digest).digest()
        pinned = ok(
            server.request("POST", f"/v1/hmac/{name}", {"message": b64(b"m"), "key_version": 1})
        )
        assert mac_tag(pinned["mac"]) == hmac.new(target, b"m", digest).digest()


def test_imported_aes_key_tokens_decrypt_outside_and_in(server: Server) -> None:
    target = os.urandom(32)
    name = "byok-aes"
    ok(import_key(server, name, "aes256-gcm", target), 201)
    enc = ok(
        server.request(
            "POST", f"/v1/encrypt/{name}", {"plaintext": b64(b"card 4111"), "aad": b64(b"row 7")}
        )
    )
    version, data = token_data(enc["ciphertext"])
    assert data[:2] == b"\x01\x01"
    nonce, sealed = data[2:14], data[14:]
    # The client decrypts cryptd's token with its own copy of the key (docs/FORMAT.md).
    plaintext = AESGCM(target).decrypt(nonce, sealed, token_ad(name, version, 1, b"row 7"))
    assert plaintext == b"card 4111"
    # And cryptd decrypts a token the client built itself.
    nonce = os.urandom(12)
    body = nonce + AESGCM(target).encrypt(nonce, b"from outside", token_ad(name, 1, 1, b""))
    token = "cryptd:v1:" + base64.urlsafe_b64encode(b"\x01\x01" + body).rstrip(b"=").decode()
    dec = ok(server.request("POST", f"/v1/decrypt/{name}", {"ciphertext": token}))
    assert base64.b64decode(dec["plaintext"]) == b"from outside"


def test_imported_private_keys_sign_and_decrypt(server: Server) -> None:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ok(import_key(server, "byok-rsa", "rsa-2048", pkcs8(private)), 201)
    described = ok(server.request("GET", "/v1/keys/byok-rsa"))
    public = serialization.load_pem_public_key(described["versions"][0]["public_key_pem"].encode())
    assert public.public_numbers() == private.public_key().public_numbers()  # type: ignore[union-attr]
    sig = ok(
        server.request("POST", "/v1/sign/byok-rsa", {"message": b64(b"m"), "algorithm": "pkcs1v15"})
    )
    private.public_key().verify(
        base64.b64decode(sig["signature"]), b"m", padding.PKCS1v15(), hashes.SHA256()
    )
    outside = private.public_key().encrypt(b"secret", OAEP)
    dec = ok(
        server.request(
            "POST",
            "/v1/decrypt/byok-rsa",
            {"ciphertext": b64(outside), "format": "rsa-oaep-sha256"},
        )
    )
    assert base64.b64decode(dec["plaintext"]) == b"secret"

    p384 = ec.generate_private_key(ec.SECP384R1())
    ok(import_key(server, "byok-p384", "ecdsa-p384", pkcs8(p384)), 201)
    sig = ok(server.request("POST", "/v1/sign/byok-p384", {"message": b64(b"m")}))
    p384.public_key().verify(base64.b64decode(sig["signature"]), b"m", ec.ECDSA(hashes.SHA384()))

    ed = ed25519.Ed25519PrivateKey.generate()
    ok(import_key(server, "byok-ed25519", "ed25519", pkcs8(ed)), 201)
    sig = ok(server.request("POST", "/v1/sign/byok-ed25519", {"message": b64(b"m")}))
    ed.public_key().verify(base64.b64decode(sig["signature"]), b"m")


def test_bad_wrapped_keys_are_400_and_store_nothing(server: Server) -> None:
    public = wrapping_public_key(server)
    material = os.urandom(32)
    good = base64.b64decode(byok_wrap(public, material))
    other = rsa.generate_private_key(public_exponent=65537, key_size=4096).public_key()
    cases = {
        "another wrapping key": (base64.b64decode(byok_wrap(other, material)), "does not decrypt"),
        "truncated": (good[:-8], "does not unwrap"),
        "cut mid-block": (good[:-5], "multiple of 8"),
        "only the RSA block": (good[:512], "too short"),
        "re-ordered": (good[512:] + good[:512], "does not decrypt"),
        "damaged key wrap": (good[:520] + bytes([good[520] ^ 1]) + good[521:], "does not unwrap"),
    }
    for what, (blob, text) in cases.items():
        name = "byok-bad-" + what.replace(" ", "-")
        response = server.request(
            "POST", f"/v1/keys/{name}/import", {"type": "aes256-gcm", "ciphertext": b64(blob)}
        )
        assert_error(response, 400, "invalid_request")
        assert text in response.json()["error"]["message"], what
        assert_error(server.request("GET", f"/v1/keys/{name}"), 404, "key_not_found")
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"type": "aes256-gcm", "ciphertext": byok_wrap(public, os.urandom(16))}, "32 bytes"),
        ({"type": "rsa-2048", "ciphertext": byok_wrap(public, material)}, "private key"),
        (
            {
                "type": "ecdsa-p384",
                "ciphertext": byok_wrap(public, pkcs8(ec.generate_private_key(ec.SECP256R1()))),
            },
            "private key",
        ),
        ({"type": "hmac-sha256", "ciphertext": byok_wrap(public, b"short")}, "16 to 1024 bytes"),
        ({"type": "aes256-gcm", "ciphertext": "%%%"}, "base64"),
        ({"type": "des", "ciphertext": byok_wrap(public, material)}, "unknown key type"),
        (
            {
                "type": "aes256-gcm",
                "ciphertext": byok_wrap(public, material),
                "hash_function": "SHA1",
            },
            "SHA256",
        ),
        (
            {"type": "rsa-2048", "ciphertext": byok_wrap(public, material), "derived": True},
            "cannot be derived",
        ),
    ]
    for body, text in refusals:
        response = server.request("POST", "/v1/keys/byok-refused/import", body)
        assert_error(response, 400, "invalid_request")
        assert text in response.json()["error"]["message"], body["type"]
    assert_error(server.request("GET", "/v1/keys/byok-refused"), 404, "key_not_found")
    assert_error(
        server.request("POST", "/v1/keys/byok-refused/import", {"type": "aes256-gcm"}),
        422,
        "invalid_request",
    )
    # An existing key, the reserved name, an unknown key for import-version.
    assert_error(import_key(server, "aes256-gcm", "aes256-gcm", material), 409, "conflict")
    reserved = import_key(server, "wrapping-key", "aes256-gcm", material)
    assert_error(reserved, 400, "invalid_request")
    assert "reserved" in reserved.json()["error"]["message"]
    # The path is the wrapping key's: GET only.
    for method, payload in (
        ("POST", {"type": "aes256-gcm"}),
        ("PATCH", {"deletion_allowed": True}),
        ("DELETE", None),
    ):
        refused = server.request(method, "/v1/keys/wrapping-key", payload)
        assert_error(refused, 405, "method_not_allowed")
        assert refused.headers["allow"] == "GET, HEAD"
    ghost = server.request(
        "POST", "/v1/keys/byok-ghost/import-version", {"ciphertext": byok_wrap(public, material)}
    )
    assert_error(ghost, 404, "key_not_found")
    wrong_type = server.request(
        "POST", "/v1/keys/aes256-gcm/import-version", {"ciphertext": byok_wrap(public, b"x" * 16)}
    )
    assert_error(wrong_type, 400, "invalid_request")
    assert ok(server.request("GET", "/v1/keys/aes256-gcm"))["latest_version"] == 1


def test_import_is_admin_only_and_audited(
    server: Server, limited_client: tuple[str, bytes]
) -> None:
    client_id, secret = limited_client
    public = wrapping_public_key(server)
    body = {"type": "aes256-gcm", "ciphertext": byok_wrap(public, os.urandom(32))}
    for method, path, payload in (
        ("GET", "/v1/keys/wrapping-key", None),
        ("POST", "/v1/keys/byok-denied/import", body),
        ("POST", "/v1/keys/aes256-gcm/import-version", {"ciphertext": body["ciphertext"]}),
        ("GET", "/v1/keys/aes256-gcm/backup", None),
        ("POST", "/v1/keys/byok-denied/restore", {"backup": "AAAA"}),
    ):
        response = server.request(method, path, payload, client_id=client_id, secret=secret)
        assert_error(response, 403, "forbidden")
    ok(server.request("POST", "/v1/keys/byok-audited/import", body), 201)
    deadline = time.monotonic() + 10
    while True:
        lines = [
            json.loads(x)
            for x in server.log().splitlines()
            if '"cryptd.audit"' in x and x.startswith("{")
        ]
        events = {(a["event"], a["key"], a["outcome"]) for a in lines}
        if ("key.import", "byok-audited", "ok") in events:
            break
        assert time.monotonic() < deadline, "no audit line for the import"
        time.sleep(0.2)
    assert ("key.import", "byok-denied", "forbidden") in events
    assert body["ciphertext"] not in server.log()


async def test_light_client_imports_backs_up_and_restores(server: Server) -> None:
    """The async client's import_key wraps locally (nothing but the wrapped bytes travels);
    import_key_version, backup_key and restore_key round-trip through the same server."""
    from cryptd_client import AsyncCryptdClient, ConflictError

    first, second = os.urandom(32), os.urandom(64)
    secret = base64.b64encode(server.secret).decode()
    async with AsyncCryptdClient(server.url, server.client_id, secret) as client:
        pem = await client.wrapping_key()
        assert pem == ok(server.request("GET", "/v1/keys/wrapping-key"))["public_key"]
        created = await client.import_key("byok-async", "hmac-sha256", first, deletion_allowed=True)
        assert (created.name, created.latest_version) == ("byok-async", 1)
        rotated = await client.import_key_version("byok-async", second)
        assert rotated.latest_version == 2
        for version, key in ((1, first), (2, second)):
            mac = await client.hmac("byok-async", b"m", key_version=version)
            assert mac_tag(mac.mac) == hmac.new(key, b"m", hashlib.sha256).digest()
        blob = await client.backup_key("byok-async")
        with pytest.raises(ConflictError):
            await client.restore_key("byok-async", blob)
        await client.delete_key("byok-async")
        restored = await client.restore_key("byok-async", blob)
        assert restored.latest_version == 2
        mac = await client.hmac("byok-async", b"m")
        assert mac_tag(mac.mac) == hmac.new(second, b"m", hashlib.sha256).digest()
        with pytest.raises(TypeError):
            await client.import_key("byok-typed", "hmac-sha256", "not bytes")  # type: ignore[arg-type]
