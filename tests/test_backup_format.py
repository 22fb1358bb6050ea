"""The key backup blob of docs/FORMAT.md section 10, checked in both directions, and the key
manager's backup and restore over real key stores (tamper, another master key, another name).

The documented vector is rebuilt here from the description alone (standard library hmac and
json, pyca's AESGCM) and opened by cryptd; restored, the key decrypts section 5's token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service import operations
from service.errors import Conflict, InvalidRequest
from service.keys import backup
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "FORMAT.md").read_text()
VECTOR: dict[str, Any] = json.loads(
    (ROOT / "tests" / "vectors" / "backup_vectors.json").read_text()
)
TOKENS: dict[str, Any] = json.loads((ROOT / "tests" / "vectors" / "token_vectors.json").read_text())


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def manager_for(directory: Path, master: MasterKey) -> KeyManager:
    directory.mkdir(exist_ok=True)
    path = directory / "keyring.json"
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master)
    manager.load()
    return manager


def test_vector_is_rebuilt_from_the_document() -> None:
    master = h(VECTOR["master_key"])
    key_id = hmac.new(master, b"cryptd master key id", hashlib.sha256).hexdigest()[:16]
    assert key_id == VECTOR["master_key_id"]
    backup_key = hmac.new(master, b"cryptd key backup", hashlib.sha256).digest()
    assert backup_key == h(VECTOR["backup_key"])
    header = b"cryptd-backup" + bytes([1]) + key_id.encode("ascii")
    assert header == h(VECTOR["header"])
    assert len(header) == 30
    payload = json.loads(VECTOR["payload"])
    assert json.dumps(payload, sort_keys=True, separators=(",", ":")) == VECTOR["payload"]
    assert payload["name"] == "doc-aes"
    assert base64.b64decode(payload["versions"][0]["material"]) == h(VECTOR["material"])
    nonce = h(VECTOR["nonce"])
    blob = header + nonce + AESGCM(backup_key).encrypt(nonce, VECTOR["payload"].encode(), header)
    assert base64.b64encode(blob).decode() == VECTOR["blob"]
    section = DOC.split("## 10. Key backup", 1)[1]
    shown = "".join(section.split("```")[-2].split())
    assert shown == VECTOR["blob"]
    for field in ("master_key", "master_key_id", "backup_key", "header", "nonce", "payload"):
        assert VECTOR[field] in section, field


def test_cryptd_opens_the_vector_and_the_restored_key_decrypts_section_5(tmp_path: Path) -> None:
    master = MasterKey(h(VECTOR["master_key"]))
    blob = base64.b64decode(VECTOR["blob"])
    name, metadata, versions = backup.open_(master, blob)
    assert name == "doc-aes"
    assert metadata["type"] == "aes256-gcm"
    assert versions == ((1, "2025-01-01T00:00:00Z", h(VECTOR["material"])),)
    manager = manager_for(tmp_path, master)
    restored = manager.restore("doc-aes", blob)
    assert restored.latest_version == 1
    assert restored.created_at == "2025-01-01T00:00:00Z"
    aes = TOKENS["aes256-gcm"]
    (outcome,) = operations.run_batch(
        manager.keyring, "decrypt", "doc-aes", [operations.DecryptItem(aes["token"], h(aes["aad"]))]
    )
    assert isinstance(outcome, dict), outcome
    assert base64.b64decode(outcome["plaintext"]) == h(aes["plaintext"])


def flip(data: bytes, index: int) -> bytes:
    changed = bytearray(data)
    changed[index] ^= 0x01
    return bytes(changed)


def test_round_trip_every_field_and_every_refusal(tmp_path: Path) -> None:
    master = MasterKey(os.urandom(32))
    source = manager_for(tmp_path / "a", master)
    source.create("k", "sm4-gcm", derived=True, convergent=True, deletion_allowed=True)
    source.rotate("k")
    source.rotate("k")
    source.update("k", min_decryption_version=2)
    blob = source.backup("k")
    target = manager_for(tmp_path / "b", master)
    before = target.store.read()
    for bad, text in (
        (flip(blob, len(blob) - 1), "does not authenticate"),
        (flip(blob, 35), "does not authenticate"),
        (flip(blob, 14), "made under master key"),
        (flip(blob, 13), "format 0 is not supported"),
        (flip(blob, 3), "not a cryptd key backup"),
        (blob[:-1], "does not authenticate"),
        (blob + b"\x00", "does not authenticate"),
        (blob[:57], "not a cryptd key backup"),
        (os.urandom(len(blob)), "not a cryptd key backup"),
    ):
        with pytest.raises(InvalidRequest, match=text):
            target.restore("k", bad)
    with pytest.raises(InvalidRequest, match="holds key 'k', not 'other'"):
        target.restore("other", blob)
    other_master = manager_for(tmp_path / "c", MasterKey(os.urandom(32)))
    with pytest.raises(InvalidRequest, match="made under master key"):
        other_master.restore("k", blob)
    assert target.store.read() == before  # nothing stored by any refusal
    restored = target.restore("k", blob)
    original = source.keyring.key("k")
    assert restored.describe() == original.describe()
    assert (restored.derived, restored.convergent) == (True, True)
    with pytest.raises(Conflict):
        target.restore("k", blob)
    # Equal convergent tokens on both sides: the same material, the same derivation.
    item = operations.EncryptItem(b"4111", context=b"cards")
    (a,) = operations.run_batch(source.keyring, "encrypt", "k", [item])
    (b,) = operations.run_batch(target.keyring, "encrypt", "k", [item])
    assert a == b
    # A second backup of the same key differs (fresh nonce) but restores the same key.
    assert source.backup("k") != blob


@pytest.mark.parametrize(
    ("type_name", "material"),
    [("rsa-2048", b"not a PKCS#8 key"), ("aes256-gcm", bytes(7)), ("ed25519", b"")],
)
def test_an_authenticated_backup_whose_material_does_not_load_is_400_and_stores_nothing(
    tmp_path: Path, type_name: str, material: bytes
) -> None:
    """Sealed under the right master key (it authenticates), but its material is not a key of
    its type: refused before anything is written, and the store keeps verifying."""
    master = MasterKey(os.urandom(32))
    target = manager_for(tmp_path / "t", master)
    target.create("kept", "aes256-gcm")
    before = target.store.read()
    metadata = {"type": type_name, "created_at": "2026-01-01T00:00:00Z"}
    blob = backup.seal(master, "bad", metadata, ((1, "2026-01-01T00:00:00Z", material),))
    with pytest.raises(InvalidRequest, match="version 1 of the key's material does not load"):
        target.restore("bad", blob)
    assert target.store.read() == before
    reopened = KeyManager(FileKeyStore(tmp_path / "t" / "keyring.json"), master)
    assert sorted(reopened.load()) == ["kept"]
