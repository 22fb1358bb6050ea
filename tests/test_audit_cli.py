"""``cryptd audit init|verify|public-key|hash`` against a real keyring file."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import pytest

from service.audit.redact import hashed
from service.cli import main
from service.keys.admin import create_keyring_file
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.logs.audit import Audit, keyring_mac
from service.stores import open_store


@pytest.fixture
def keyring(tmp_path: Path) -> list[str]:
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    create_keyring_file(tmp_path / "keyring.json", MasterKey(master))
    return ["--keyring", str(tmp_path / "keyring.json"), "--master-key-file",
            str(tmp_path / "master.key")]  # fmt: skip


def manager_of(options: list[str]) -> KeyManager:
    master = base64.b64decode(Path(options[3]).read_text())
    manager = KeyManager(open_store(None, Path(options[1])), MasterKey(master))
    manager.load()
    return manager


def test_init_verify_public_key_and_hash(
    tmp_path: Path, keyring: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    trail = tmp_path / "audit.log"
    trail.write_bytes(b"")
    assert main(["audit", "verify", str(trail), *keyring]) == 2  # no signing key yet
    assert "cryptd:audit-signing" in capsys.readouterr().err
    assert main(["audit", "init", *keyring]) == 0
    assert "cryptd:audit-signing: created" in capsys.readouterr().out
    assert main(["audit", "init", *keyring]) == 0
    assert "cryptd:audit-hmac: present" in capsys.readouterr().out

    audit = Audit.to_file(str(trail), manager_of(keyring), checkpoint_every=3)
    for n in range(7):
        audit.record("key.destroy", client=None, key=f"k{n}", outcome="ok")
    audit.close()

    assert main(["audit", "verify", str(trail), "--sealed", *keyring]) == 0
    assert "audit trail verified" in capsys.readouterr().out
    assert main(["audit", "public-key", *keyring]) == 0
    keys = tmp_path / "audit-keys.json"
    keys.write_text(capsys.readouterr().out)
    assert main(["audit", "verify", str(trail), "--public-key", str(keys)]) == 0
    capsys.readouterr()

    lines = trail.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"k1"', b'"k9"')
    trail.write_bytes(b"".join(lines))
    assert main(["audit", "verify", str(trail), "--public-key", str(keys)]) == 1
    assert f"FAILED: {trail}:4 (seq 4)" in capsys.readouterr().out

    assert main(["audit", "hash", "invoice-77", *keyring]) == 0
    expected = hashed(keyring_mac(manager_of(keyring)), b"invoice-77")
    assert capsys.readouterr().out.strip() == expected
