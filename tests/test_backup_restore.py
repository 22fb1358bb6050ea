"""Backup and restore of one key between two real servers holding the same master key (each with
its own key store), and the refusals: another master key, a damaged or foreign blob, a name that
is taken or not the backup's."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import decode_master_key
from service.keys.backup import seal
from service.keys.masterkey import MasterKey
from tests.conftest import Server, start_server, stop_server
from tests.test_api import assert_error

pytestmark = pytest.mark.slow  # two live servers


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """Server A, and server B started from A's master key and client but its own keyring."""
    first = start_server(tmp_path_factory.mktemp("backup-a"))
    second_dir = tmp_path_factory.mktemp("backup-b")
    (second_dir / "dev").mkdir(mode=0o700)
    for name in ("master.key", "clients.json"):
        shutil.copy2(first.directory / "dev" / name, second_dir / "dev" / name)
    try:
        second = start_server(second_dir)
    except BaseException:
        stop_server(first)
        raise
    yield first, second
    stop_server(second)
    stop_server(first)


def backup(server: Server, name: str) -> str:
    blob = ok(server.request("GET", f"/v1/keys/{name}/backup"))["backup"]
    assert isinstance(blob, str)
    return blob


def metadata(server: Server, name: str) -> dict[str, Any]:
    """The key's metadata without its usage: usage counts the traffic of the server that
    answers, so a backup does not carry it (a restored key starts at zero, checked here)."""
    body = ok(server.request("GET", f"/v1/keys/{name}"))
    for version in body["versions"]:
        assert set(version.pop("usage")) == {"operations", "total", "last_used_at"}
    return body


def usage_totals(server: Server, name: str) -> list[int]:
    versions = ok(server.request("GET", f"/v1/keys/{name}"))["versions"]
    return [v["usage"]["total"] for v in versions]


def restore(server: Server, name: str, blob: str) -> httpx.Response:
    return server.request("POST", f"/v1/keys/{name}/restore", {"backup": blob})


def test_a_restored_key_decrypts_the_first_servers_tokens(pair: tuple[Server, Server]) -> None:
    a, b = pair
    assert a.url != b.url
    ok(a.request("POST", "/v1/keys/bk-aes", {"type": "aes256-gcm"}), 201)
    old = ok(a.request("POST", "/v1/encrypt/bk-aes", {"plaintext": b64(b"v1"), "aad": b64(b"x")}))
    ok(a.request("POST", "/v1/keys/bk-aes/rotate"))
    new = ok(a.request("POST", "/v1/encrypt/bk-aes", {"plaintext": b64(b"v2")}))
    assert new["key_version"] == 2
    blob = backup(a, "bk-aes")
    assert_error(b.request("GET", "/v1/keys/bk-aes"), 404, "key_not_found")
    restored = ok(restore(b, "bk-aes", blob), 201)
    original = metadata(a, "bk-aes")
    assert restored == {k: v for k, v in original.items() if k != "versions"}
    assert metadata(b, "bk-aes") == original  # versions, dates, metadata
    assert usage_totals(b, "bk-aes") == [0, 0]
    first = ok(
        b.request("POST", "/v1/decrypt/bk-aes", {"ciphertext": old["ciphertext"], "aad": b64(b"x")})
    )
    assert first == {"plaintext": b64(b"v1"), "key_version": 1}
    second = ok(b.request("POST", "/v1/decrypt/bk-aes", {"ciphertext": new["ciphertext"]}))
    assert second == {"plaintext": b64(b"v2"), "key_version": 2}
    # And the other way: A decrypts what B encrypts with the restored key.
    from_b = ok(b.request("POST", "/v1/encrypt/bk-aes", {"plaintext": b64(b"back")}))
    assert ok(a.request("POST", "/v1/decrypt/bk-aes", {"ciphertext": from_b["ciphertext"]}))[
        "plaintext"
    ] == b64(b"back")
    # Restoring over an existing key is refused, on both servers.
    assert_error(restore(b, "bk-aes", blob), 409, "conflict")
    assert_error(restore(a, "bk-aes", blob), 409, "conflict")


def test_every_kind_of_key_and_its_metadata_survive(pair: tuple[Server, Server]) -> None:
    a, b = pair
    ok(
        a.request(
            "POST", "/v1/keys/bk-conv", {"type": "sm4-gcm", "derived": True, "convergent": True}
        ),
        201,
    )
    ok(a.request("POST", "/v1/keys/bk-rsa", {"type": "rsa-2048", "deletion_allowed": True}), 201)
    ok(a.request("POST", "/v1/keys/bk-hmac", {"type": "hmac-sha512"}), 201)
    ok(a.request("POST", "/v1/keys/bk-hmac/rotate"))
    ok(a.request("POST", "/v1/keys/bk-hmac/rotate"))
    ok(a.request("PATCH", "/v1/keys/bk-hmac", {"min_decryption_version": 2}))
    conv = {"plaintext": b64(b"4111111111111111"), "context": b64(b"cards")}
    token = ok(a.request("POST", "/v1/encrypt/bk-conv", conv))["ciphertext"]
    signature = ok(a.request("POST", "/v1/sign/bk-rsa", {"message": b64(b"m")}))["signature"]
    macs = [
        ok(a.request("POST", "/v1/hmac/bk-hmac", {"message": b64(b"m"), "key_version": v}))["mac"]
        for v in (2, 3)
    ]
    for name in ("bk-conv", "bk-rsa", "bk-hmac"):
        ok(restore(b, name, backup(a, name)), 201)
        assert metadata(b, name) == metadata(a, name)
    assert ok(b.request("POST", "/v1/encrypt/bk-conv", conv))["ciphertext"] == token
    verified = b.request(
        "POST", "/v1/verify/bk-rsa", {"message": b64(b"m"), "signature": signature}
    )
    assert ok(verified) == {"valid": True}
    for version, mac in zip((2, 3), macs, strict=True):
        again = ok(
            b.request("POST", "/v1/hmac/bk-hmac", {"message": b64(b"m"), "key_version": version})
        )
        assert again["mac"] == mac
    assert_error(
        b.request("POST", "/v1/hmac/bk-hmac", {"message": "", "key_version": 1}),
        400,
        "invalid_request",
    )


def test_post_quantum_keys_survive(pair: tuple[Server, Server]) -> None:
    """ML-DSA, composite and X-Wing keys restored on B: B verifies A's signatures (with their
    context) and opens A's HPKE token, and both publish the same public keys."""
    a, b = pair
    ok(a.request("POST", "/v1/keys/bk-mldsa", {"type": "ml-dsa-65"}), 201)
    ok(a.request("POST", "/v1/keys/bk-xwing", {"type": "x25519-ml-kem-768"}), 201)
    ok(a.request("POST", "/v1/keys/bk-xwing/rotate"))
    ok(a.request("POST", "/v1/keys/bk-composite", {"type": "ml-dsa-65-sm2"}), 201)
    signing = {"message": b64(b"m"), "context": b64(b"ctx")}
    signature = ok(a.request("POST", "/v1/sign/bk-mldsa", signing))["signature"]
    composite = ok(a.request("POST", "/v1/sign/bk-composite", signing))["signature"]
    sealed = {"plaintext": b64(b"pq"), "aad": b64(b"a"), "key_version": 1}
    token = ok(a.request("POST", "/v1/encrypt/bk-xwing", sealed))["ciphertext"]
    for name in ("bk-mldsa", "bk-xwing", "bk-composite"):
        ok(restore(b, name, backup(a, name)), 201)
        assert metadata(b, name) == metadata(a, name)
        keys_a = [v.get("public_key_raw") or v["public_key_pem"] for v in versions(a, name)]
        assert keys_a == [v.get("public_key_raw") or v["public_key_pem"] for v in versions(b, name)]
    verified = b.request("POST", "/v1/verify/bk-mldsa", {**signing, "signature": signature})
    assert ok(verified) == {"valid": True}
    verified = b.request("POST", "/v1/verify/bk-composite", {**signing, "signature": composite})
    assert ok(verified) == {"valid": True}
    opened = ok(b.request("POST", "/v1/decrypt/bk-xwing", {"ciphertext": token, "aad": b64(b"a")}))
    assert opened["plaintext"] == b64(b"pq")


def versions(server: Server, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = ok(server.request("GET", f"/v1/keys/{name}"))["versions"]
    return found


def test_restore_refusals(pair: tuple[Server, Server], server: Server) -> None:
    a, b = pair
    ok(a.request("POST", "/v1/keys/bk-refuse", {"type": "aes256-gcm"}), 201)
    blob = backup(a, "bk-refuse")
    raw = base64.b64decode(blob)

    def refused(target: Server, name: str, text: str, data: str) -> None:
        response = restore(target, name, data)
        assert_error(response, 400, "invalid_request")
        assert text in response.json()["error"]["message"]
        if name != "wrapping-key":  # that path is the wrapping key's
            assert_error(target.request("GET", f"/v1/keys/{name}"), 404, "key_not_found")

    def changed(index: int) -> str:
        data = bytearray(raw)
        data[index] ^= 0x01
        return b64(bytes(data))

    # The session server holds another master key.
    refused(server, "bk-refuse", "made under master key", blob)
    refused(b, "bk-other-name", "holds key 'bk-refuse'", blob)
    refused(b, "bk-refuse", "does not authenticate", changed(len(raw) - 1))
    refused(b, "bk-refuse", "does not authenticate", changed(40))
    refused(b, "bk-refuse", "made under master key", changed(20))
    refused(b, "bk-refuse", "format 0 is not supported", changed(13))
    refused(b, "bk-refuse", "not a cryptd key backup", changed(0))
    refused(b, "bk-refuse", "does not authenticate", b64(raw[:-1]))
    refused(b, "bk-refuse", "not a cryptd key backup", b64(raw[:40]))
    refused(b, "bk-refuse", "not a cryptd key backup", b64(b""))
    refused(b, "bk-refuse", "base64", "not base64!")
    refused(b, "wrapping-key", "reserved", blob)
    assert_error(b.request("POST", "/v1/keys/bk-refuse/restore", {}), 422, "invalid_request")
    assert_error(a.request("GET", "/v1/keys/bk-ghost/backup"), 404, "key_not_found")
    # The internal wrapping key is never exported: its path names no user key.
    ok(a.request("GET", "/v1/keys/wrapping-key"))
    assert_error(a.request("GET", "/v1/keys/wrapping-key/backup"), 404, "key_not_found")
    # After all that, the genuine blob still restores.
    ok(restore(b, "bk-refuse", blob), 201)


def test_backup_and_restore_are_audited_without_material(pair: tuple[Server, Server]) -> None:
    a, b = pair
    ok(a.request("POST", "/v1/keys/bk-audit", {"type": "hmac-sm3"}), 201)
    blob = backup(a, "bk-audit")
    ok(restore(b, "bk-audit", blob), 201)
    for server, event in ((a, "key.backup"), (b, "key.restore")):
        deadline = time.monotonic() + 10
        while True:
            lines = [
                json.loads(x)
                for x in server.log().splitlines()
                if x.startswith("{") and '"cryptd.audit"' in x
            ]
            if any(
                r["event"] == event and r["key"] == "bk-audit" and r["outcome"] == "ok"
                for r in lines
            ):
                break
            assert time.monotonic() < deadline, f"no {event} audit line"
            time.sleep(0.2)
        assert blob not in server.log()
        assert blob[:40] not in server.log()


def test_dev_state_of_the_second_server_is_its_own(pair: tuple[Server, Server]) -> None:
    a, b = pair
    assert Path(a.directory) != Path(b.directory)
    # Both have a key called aes256-gcm (the development keyring), but not the same material.
    token = ok(a.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64(b"x")}))["ciphertext"]
    assert_error(
        b.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": token}), 400, "decryption_failed"
    )


def test_an_authenticated_backup_whose_material_does_not_load_is_400(
    pair: tuple[Server, Server],
) -> None:
    """Sealed under the server's own master key, so it authenticates, but its material is not
    an RSA key: 400, nothing stored, and every worker stays ready (no failed verification)."""
    _, server = pair
    master_text = (server.directory / "dev" / "master.key").read_text()
    master = MasterKey(decode_master_key(master_text, "master.key"))
    metadata = {"type": "rsa-2048", "created_at": "2026-01-01T00:00:00Z"}
    blob = seal(master, "unloadable", metadata, ((1, "2026-01-01T00:00:00Z", b"not a key"),))
    keyring = server.directory / "dev" / "keyring.json"
    before = keyring.read_bytes()
    refused = restore(server, "unloadable", b64(blob))
    assert_error(refused, 400, "invalid_request")
    assert "does not load as rsa-2048" in refused.json()["error"]["message"]
    assert keyring.read_bytes() == before
    assert server.request("GET", "/v1/keys/unloadable").status_code == 404
    for _ in range(4):  # on whichever worker answers
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
