"""`cryptd call hmac|random|verify --mac|datakey --no-plaintext|create --derived` against a real
server, and `cryptd keys create --derived --import` (hex, as its help says) on a keyring file."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import pytest

from service import operations
from service.cli import main
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from tests.conftest import Server

ROOT = Path(__file__).parent.parent
TOKENS = json.loads((ROOT / "tests" / "vectors" / "token_vectors.json").read_text())


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    status = main(args)
    out = capsys.readouterr()
    return status, json.loads(out.out) if out.out.strip() else None, out.err


@pytest.mark.slow
def test_call_new_operations(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    cred = ["--credential", str(server.directory / "dev" / "client.json")]
    status, mac, _ = run(["call", "hmac", "hmac-sha256", "--data", "hello", *cred], capsys)
    assert status == 0
    assert mac["mac"].startswith("cryptd:v1:")
    verify = ["call", "verify", "hmac-sha256", "--data", "hello", "--mac", mac["mac"], *cred]
    assert run(verify, capsys)[:2] == (0, {"valid": True})
    verify[4] = "hellO"
    assert run(verify, capsys)[:2] == (1, {"valid": False})

    status, random, _ = run(["call", "random", "--bytes", "24", *cred], capsys)
    assert status == 0
    assert len(base64.b64decode(random["random"])) == 24
    status, _, err = run(["call", "random", "--bytes", "0", *cred], capsys)
    assert status == 1
    assert json.loads(err)["error"]["code"] == "invalid_request"

    status, wrapped, _ = run(["call", "datakey", "aes256-gcm", "--no-plaintext", *cred], capsys)
    assert status == 0
    assert set(wrapped) == {"ciphertext", "key_version"}

    create = ["call", "create", "parity-cli-conv", "--type", "aes256-gcm", "--derived"]
    status, created, _ = run([*create, "--convergent", *cred], capsys)
    assert status == 0
    assert (created["derived"], created["convergent"]) == (True, True)
    encrypt = ["call", "encrypt", "parity-cli-conv", "--data", "x", "--context", "t", *cred]
    first, second = run(encrypt, capsys)[1], run(encrypt, capsys)[1]
    assert first == second
    status, _, err = run(["call", "encrypt", "parity-cli-conv", "--data", "x", *cred], capsys)
    assert status == 1
    assert "context" in json.loads(err)["error"]["message"]

    sign = ["call", "sign", "ecdsa-p384", "--data", "m", "--hash-algorithm", "sha2-512", *cred]
    status, signed, _ = run(sign, capsys)
    assert status == 0
    check = ["call", "verify", "ecdsa-p384", "--data", "m", "--signature", signed["signature"]]
    assert run([*check, "--hash-algorithm", "sha2-512", *cred], capsys)[:2] == (0, {"valid": True})
    assert run([*check, *cred], capsys)[:2] == (1, {"valid": False})  # default: SHA-384


@pytest.fixture
def keyring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, MasterKey]:
    key = os.urandom(32)
    (tmp_path / "master.key").write_text(base64.b64encode(key).decode())
    monkeypatch.setenv("CRYPTD_MASTER_KEY_FILE", str(tmp_path / "master.key"))
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(tmp_path / "keyring.json"))
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    return tmp_path / "keyring.json", MasterKey(key)


def load(keyring: tuple[Path, MasterKey]) -> KeyManager:
    manager = KeyManager(FileKeyStore(keyring[0]), keyring[1])
    manager.load()
    return manager


def test_keys_create_imports_hex_as_documented(
    tmp_path: Path, keyring: tuple[Path, MasterKey], capsys: pytest.CaptureFixture[str]
) -> None:
    vector = TOKENS["aes256-gcm"]
    hex_file = tmp_path / "aes.hex"
    # Hex digits, upper case, split over lines: what `xxd -p` or an HSM export prints.
    digits = vector["key"].upper()
    hex_file.write_text(digits[:32] + "\n" + digits[32:] + "\n")
    status, created, err = run(["keys", "create", vector["name"], "--type", "aes256-gcm",
                                "--import", str(hex_file)], capsys)  # fmt: skip
    assert status == 0, err
    assert created["name"] == vector["name"]
    # The imported key is the documented one: it opens docs/FORMAT.md's token.
    (outcome,) = operations.run_batch(
        load(keyring).keyring,
        "decrypt",
        vector["name"],
        [operations.DecryptItem(vector["token"], bytes.fromhex(vector["aad"]))],
    )
    assert isinstance(outcome, dict)
    assert base64.b64decode(outcome["plaintext"]) == bytes.fromhex(vector["plaintext"])

    hmac_key = os.urandom(48)
    (tmp_path / "hmac.hex").write_text(hmac_key.hex())
    status, created, err = run(["keys", "create", "tags", "--type", "hmac-sha512", "--derived",
                                "--import", str(tmp_path / "hmac.hex")], capsys)  # fmt: skip
    assert status == 0, err
    assert created["derived"] is True
    raw = os.urandom(32)  # raw bytes, not hex (all 32 bytes hex digits: probability 1e-34)
    (tmp_path / "raw.bin").write_bytes(raw)
    status, _, err = run(["keys", "create", "plain-tags", "--type", "hmac-sha256",
                          "--import", str(tmp_path / "raw.bin")], capsys)  # fmt: skip
    assert status == 0, err
    manager = load(keyring)
    (tag,) = operations.run_batch(
        manager.keyring, "hmac", "plain-tags", [operations.HmacItem(b"m")]
    )
    assert isinstance(tag, dict)
    expected = hmac.new(raw, b"m", hashlib.sha256).digest()
    assert tag["mac"] == "cryptd:v1:" + base64.urlsafe_b64encode(expected).rstrip(b"=").decode()
    status, shown, _ = run(["keys", "show", "tags"], capsys)
    assert (status, shown["derived"], shown["convergent"]) == (0, True, False)


@pytest.mark.parametrize(
    ("content", "type_name", "text"),
    [
        (b"abc", "aes256-gcm", "odd number of hex digits"),
        (b"00" * 16, "aes256-gcm", "must be 32 bytes"),
        (b"00" * 8, "hmac-sha256", "16 to 1024 bytes"),
    ],
)
def test_keys_create_refuses_bad_imports(
    tmp_path: Path,
    keyring: tuple[Path, MasterKey],
    capsys: pytest.CaptureFixture[str],
    content: bytes,
    type_name: str,
    text: str,
) -> None:
    (tmp_path / "key").write_bytes(content)
    status, _, err = run(["keys", "create", "k", "--type", type_name, "--import",
                          str(tmp_path / "key")], capsys)  # fmt: skip
    assert status in (1, 2)
    assert text in err
    if keyring[0].exists():
        assert "k" not in load(keyring).keyring


def test_keys_create_refuses_flags_the_type_cannot_have(
    keyring: tuple[Path, MasterKey], capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(["keys", "create", "k", "--type", "rsa-2048", "--derived"], capsys)
    assert status == 1
    assert "cannot be derived" in err
    status, _, err = run(["keys", "create", "k", "--type", "sm4-gcm", "--convergent"], capsys)
    assert status == 1
    assert "needs 'derived'" in err


@pytest.mark.slow
def test_call_import_backup_restore(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    cred = ["--credential", str(server.directory / "dev" / "client.json")]
    status, wrapping, _ = run(["call", "wrapping-key", *cred], capsys)
    assert status == 0
    assert wrapping["public_key"].startswith("-----BEGIN PUBLIC KEY-----")

    key = os.urandom(32)
    (tmp_path / "key.hex").write_text(key.hex() + "\n")
    args = ["call", "import", "cli-imported", "--type", "hmac-sha256", "--deletion-allowed"]
    status, created, err = run([*args, "--data-file", str(tmp_path / "key.hex"), *cred], capsys)
    assert status == 0, err
    assert (created["name"], created["deletion_allowed"]) == ("cli-imported", True)
    status, mac, _ = run(["call", "hmac", "cli-imported", "--data", "m", *cred], capsys)
    expected = hmac.new(key, b"m", hashlib.sha256).digest()
    assert mac["mac"] == "cryptd:v1:" + base64.urlsafe_b64encode(expected).rstrip(b"=").decode()

    private = ec.generate_private_key(ec.SECP521R1())
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "p521.pem").write_bytes(pem)
    args = ["call", "import", "cli-p521", "--type", "ecdsa-p521"]
    assert run([*args, "--data-file", str(tmp_path / "p521.pem"), *cred], capsys)[0] == 0
    status, signed, _ = run(["call", "sign", "cli-p521", "--data", "m", *cred], capsys)
    private.public_key().verify(
        base64.b64decode(signed["signature"]), b"m", ec.ECDSA(hashes.SHA512())
    )
    legacy = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    (tmp_path / "legacy.pem").write_bytes(legacy)
    args = ["call", "import", "cli-legacy", "--type", "ecdsa-p521"]
    status, _, err = run([*args, "--data-file", str(tmp_path / "legacy.pem"), *cred], capsys)
    assert status == 2
    assert "PKCS#8" in err

    status, saved, _ = run(["call", "backup", "cli-imported", *cred], capsys)
    assert status == 0
    blob = saved["backup"]
    status, _, err = run(["call", "restore", "cli-imported", "--data", blob, *cred], capsys)
    assert status == 1
    assert json.loads(err)["error"]["code"] == "conflict"
    assert server.request("DELETE", "/v1/keys/cli-imported").status_code == 204
    status, restored, err = run(["call", "restore", "cli-imported", "--data", blob, *cred], capsys)
    assert status == 0, err
    assert restored["name"] == "cli-imported"
    assert run(["call", "hmac", "cli-imported", "--data", "m", *cred], capsys)[1] == mac
