"""The file key store under damage, from outside: a real server, a keyring edited by hand, a
file it cannot read, a full disk. Key management answers 503 ``keystore_unavailable``, the file
stays byte for byte what it was (never rewritten with a fresh MAC), crypto keeps serving from
memory, and once the cause is gone management works again with nobody restarting anything."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.test_keystore_support import (
    b64,
    fill,
    keyring_check,
    server_on_small_tmpfs,
    wait_for,
    without_file_access_override,
)

pytestmark = pytest.mark.slow

Json = dict[str, object]


def management_calls(server: Server) -> list[tuple[str, Callable[[], httpx.Response]]]:
    """Every key-management write, each aimed at something that would succeed on a sound
    keyring."""
    return [
        ("create", lambda: server.request("POST", "/v1/keys/other", {"type": "aes256-gcm"})),
        ("rotate", lambda: server.request("POST", "/v1/keys/aes256-gcm/rotate")),
        (
            "update",
            lambda: server.request("PATCH", "/v1/keys/sm4-gcm", {"deletion_allowed": False}),
        ),
        ("delete", lambda: server.request("DELETE", "/v1/keys/ed25519")),
    ]


def assert_all_refused(server: Server, keyring: Path, before: bytes, reason: str) -> None:
    for label, call in management_calls(server):
        response = call()
        assert response.status_code == 503, (label, response.status_code, response.text)
        error = response.json()["error"]
        assert error["code"] == "keystore_unavailable", label
        assert reason in error["message"], (label, error["message"])
        assert "nothing was changed" in error["message"]
        assert keyring.read_bytes() == before, f"{label} rewrote the keyring"


def encrypt(server: Server, key: str, text: bytes) -> str:
    response = server.request("POST", f"/v1/encrypt/{key}", {"plaintext": b64(text)})
    assert response.status_code == 200, response.text
    token: str = response.json()["ciphertext"]
    return token


def decrypts(server: Server, key: str, token: str, text: bytes) -> bool:
    response = server.request("POST", f"/v1/decrypt/{key}", {"ciphertext": token})
    return response.status_code == 200 and base64.b64decode(response.json()["plaintext"]) == text


def reload_failed(server: Server) -> bool:
    return "last_reload_error" in keyring_check(server)


def reload_ok(server: Server) -> bool:
    return "last_reload_error" not in keyring_check(server)


def edit(keyring: Path, change: Callable[[dict[str, dict[str, Json]]], None]) -> None:
    data = orjson.loads(keyring.read_bytes())
    change(data)
    keyring.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def drop_victim(data: dict[str, dict[str, Json]]) -> None:
    del data["keys"]["victim"]


def flip_material_byte(data: dict[str, dict[str, Json]]) -> None:
    versions = data["keys"]["aes256-gcm"]["versions"]
    assert isinstance(versions, list)
    blob = bytearray(base64.b64decode(versions[0]["material"]))
    blob[20] ^= 0x01
    versions[0]["material"] = base64.b64encode(bytes(blob)).decode()


def lower_min_decryption_version(data: dict[str, dict[str, Json]]) -> None:
    data["keys"]["victim"]["min_decryption_version"] = 1


@pytest.mark.parametrize("damage", [drop_victim, flip_material_byte, lower_min_decryption_version])
def test_a_hand_edited_keyring_is_never_laundered(
    tmp_path: Path, damage: Callable[[dict[str, dict[str, Json]]], None]
) -> None:
    server = start_server(tmp_path)
    keyring = tmp_path / "dev" / "keyring.json"
    try:
        assert server.request("POST", "/v1/keys/victim", {"type": "aes256-gcm"}).status_code == 201
        assert server.request("POST", "/v1/keys/victim/rotate").status_code == 200
        patched = server.request("PATCH", "/v1/keys/victim", {"min_decryption_version": 2})
        assert patched.status_code == 200
        token = encrypt(server, "victim", b"keep me")
        pristine = keyring.read_bytes()

        edit(keyring, damage)
        wait_for(lambda: reload_failed(server), what="the refused reload")
        ready = server.request("GET", "/readyz").json()
        assert ready["status"] == "degraded"
        assert "integrity" in ready["checks"]["keyring"]["last_reload_error"]

        damaged = keyring.read_bytes()
        assert_all_refused(server, keyring, damaged, "failed verification")
        # The keyring loaded before the damage still serves, min_decryption_version included.
        assert decrypts(server, "victim", token, b"keep me")
        assert decrypts(server, "aes256-gcm", encrypt(server, "aes256-gcm", b"x"), b"x")
        low = server.request("POST", "/v1/encrypt/victim", {"plaintext": "eA==", "key_version": 1})
        assert low.status_code == 400

        # Restored from the backup: management works again, nobody restarted anything.
        keyring.write_bytes(pristine)
        wait_for(lambda: reload_ok(server), what="the reload of the restored keyring")
        created = server.request("POST", "/v1/keys/other", {"type": "aes256-gcm"})
        assert created.status_code == 201, created.text
        assert decrypts(server, "victim", token, b"keep me")
    finally:
        stop_server(server)
    # A new process loads what the last write left, and the token still opens.
    again = start_server(tmp_path)
    try:
        assert decrypts(again, "victim", token, b"keep me")
        assert again.request("GET", "/v1/keys/other").status_code == 200
    finally:
        stop_server(again)


def test_an_unreadable_keyring_refuses_management(tmp_path: Path) -> None:
    server = start_server(tmp_path, prefix=without_file_access_override())
    keyring = tmp_path / "dev" / "keyring.json"
    try:
        token = encrypt(server, "aes256-gcm", b"still here")
        before = keyring.read_bytes()
        mode = keyring.stat().st_mode
        os.chmod(keyring, 0)
        try:
            assert_all_refused(server, keyring, before, "cannot be read")
            assert decrypts(server, "aes256-gcm", token, b"still here")
        finally:
            os.chmod(keyring, mode)
        created = server.request("POST", "/v1/keys/other", {"type": "aes256-gcm"})
        assert created.status_code == 201, created.text
    finally:
        stop_server(server)


def test_a_full_disk_refuses_management_and_half_writes_nothing(tmp_path: Path) -> None:
    with server_on_small_tmpfs(tmp_path) as (server, state):
        keyring = state / "keyring.json"
        token = encrypt(server, "aes256-gcm", b"on a full disk")
        before = keyring.read_bytes()
        filler = fill(state)
        assert_all_refused(server, keyring, before, "could not be written")
        leftovers = [p.name for p in state.iterdir() if p.name.startswith(".keyring.json.")]
        assert leftovers == [], "a temporary file was left behind"
        assert decrypts(server, "aes256-gcm", token, b"on a full disk")
        # The keyring in memory is unchanged too: the refused create left no key behind.
        assert server.request("GET", "/v1/keys/other").status_code == 404

        filler.unlink()
        created = server.request("POST", "/v1/keys/other", {"type": "aes256-gcm"})
        assert created.status_code == 201, created.text
        assert decrypts(server, "other", encrypt(server, "other", b"y"), b"y")
