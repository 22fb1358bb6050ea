"""SoftHSM2 tokens for the seal tests: a private configuration and token directory per test."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.auth.clients import generate_secret, write_document
from service.keys.admin import initialise
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey

SOFTHSM_MODULE = Path("/usr/lib/softhsm/libsofthsm2.so")
PIN = "4711-seal"
SO_PIN = "so-4711-seal"


@dataclass
class Token:
    conf: Path
    directory: Path
    label: str
    pin_file: Path

    def env(self) -> dict[str, str]:
        return {
            "SOFTHSM2_CONF": str(self.conf),
            "CRYPTD_SEAL": "pkcs11",
            "CRYPTD_PKCS11_MODULE": str(SOFTHSM_MODULE),
            "CRYPTD_PKCS11_TOKEN_LABEL": self.label,
            "CRYPTD_PKCS11_PIN_FILE": str(self.pin_file),
        }

    def remove(self) -> Path:
        """Take the token away (as if unplugged); returns where it went."""
        away = self.directory.with_name(self.directory.name + ".away")
        self.directory.rename(away)
        return away

    def restore(self, away: Path) -> None:
        away.rename(self.directory)


def require_softhsm() -> None:
    missing = [
        what
        for what, ok in (
            ("softhsm2-util", shutil.which("softhsm2-util") is not None),
            (str(SOFTHSM_MODULE), SOFTHSM_MODULE.exists()),
        )
        if not ok
    ]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SoftHSM2 is required under CI (apt-get install softhsm2): {missing}")
        pytest.skip(f"SoftHSM2 is not installed: {missing}")
    pytest.importorskip("pkcs11")


def make_token(base: Path, label: str = "cryptd-test", pin: str = PIN) -> Token:
    """A fresh SoftHSM2 token in ``base`` with its own configuration file."""
    require_softhsm()
    base.mkdir(parents=True, exist_ok=True)
    directory = base / "tokens"
    directory.mkdir(mode=0o700)
    conf = base / "softhsm2.conf"
    conf.write_text(
        f"directories.tokendir = {directory}\nobjectstore.backend = file\nlog.level = ERROR\n"
    )
    subprocess.run(
        [
            "softhsm2-util",
            "--init-token",
            "--free",
            "--label",
            label,
            "--pin",
            pin,
            "--so-pin",
            SO_PIN,
        ],
        env={**os.environ, "SOFTHSM2_CONF": str(conf)},
        check=True,
        capture_output=True,
    )
    pin_file = base / "pin"
    pin_file.write_text(pin + "\n")
    pin_file.chmod(0o600)
    return Token(conf, directory, label, pin_file)


def make_store(directory: Path, master: bytes) -> bytes:
    """What `cryptd keystore init`, `keys create` and `clients add` make (tests/test_seal*.py
    run those commands under each seal): a keyring file with the AES key ``payments`` under
    ``master``, and ``clients.json`` with the admin client ``app``. Returns its secret."""
    store = FileKeyStore(directory / "keyring.json")
    initialise(store, MasterKey(master))
    manager = KeyManager(store, MasterKey(master))
    manager.load()
    manager.create("payments", "aes256-gcm")
    secret = generate_secret()
    clients = {
        "app": {"secret": secret, "admin": True, "allow": [{"keys": "*", "operations": ["*"]}]}
    }
    write_document(directory / "clients.json", {"clients": clients})
    return base64.b64decode(secret)
