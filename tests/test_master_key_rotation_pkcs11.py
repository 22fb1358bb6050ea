"""Master-key rotation under the pkcs11 seal (SoftHSM2): the new master key sealed by the same
non-extractable token key in a new sealed file, every version rewrapped, a worker holding the
old key moving to the new one through the token, a backup made before restoring after, and a
rotating process SIGKILLed before its promotion settled at the next start."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from service import operations
from service.config import SealSettings
from service.errors import CryptdError
from service.keys.admin import initialise
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.seal import pkcs11 as pkcs11_seal
from service.seal import sealedfile
from service.seal.pkcs11 import Pkcs11Seal
from service.seal.rotation import SealedKeyFiles, settle_store
from tests.test_seal_support import SOFTHSM_MODULE, Token, make_token

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import service.seal.rotation as rotation

    def promoting(self):
        os.kill(os.getpid(), signal.SIGKILL)  # the store committed, the key not promoted

    rotation.SealedKeyFiles.promote = promoting
    from service.cli import main
    sys.exit(main(["operator", "rotate-master-key"]))
    """
)


def _env(token: Token, keyring: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    env.update(token.env(), CRYPTD_KEYRING_FILE=str(keyring), PYTHONPATH=str(ROOT))
    return env


def _decrypts(manager: KeyManager, token: str, expected: bytes) -> None:
    [result] = operations.run_batch(
        manager.keyring, "decrypt", "payments", [operations.DecryptItem(token)]
    )
    assert not isinstance(result, CryptdError), result
    assert base64.b64decode(result["plaintext"]) == expected


def test_pkcs11_rotation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = make_token(tmp_path / "hsm")
    monkeypatch.setenv("SOFTHSM2_CONF", str(token.conf))
    pkcs11_seal.reinitialize(SOFTHSM_MODULE)
    keyring = tmp_path / "keyring.json"
    sealed = tmp_path / "sealed-master-key.json"
    env = _env(token, keyring)
    subprocess.run(
        [sys.executable, "-m", "service", "operator", "init"], env=env, check=True, timeout=60
    )
    seal = Pkcs11Seal(SOFTHSM_MODULE, token.label, "cryptd-seal", token.pin_file, sealed)
    files = SealedKeyFiles(seal)
    try:
        old = files.current()
        store = FileKeyStore(keyring)
        initialise(store, old)
        worker = KeyManager(store, old, lookup=files)
        worker.load()
        worker.create("payments", "aes256-gcm")
        worker.rotate("payments")
        worker.create("signing", "ed25519")
        [sealed_token] = operations.run_batch(
            worker.keyring, "encrypt", "payments", [operations.EncryptItem(b"before")]
        )
        assert not isinstance(sealed_token, CryptdError)
        before = str(sealed_token["ciphertext"])
        backup = worker.backup("payments")

        # A rotation by another process (its own token session).
        done = subprocess.run(
            [sys.executable, "-m", "service", "operator", "rotate-master-key"],
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        report = orjson.loads(done.stdout)
        assert report["seal"] == "pkcs11"
        assert report["previous_master_key_id"] == old.key_id
        assert report["versions"] == 3
        assert sealedfile.read(sealed).key_id == report["master_key_id"] != old.key_id
        retired = tmp_path / f"sealed-master-key.json.retired-{old.key_id}"
        assert sealedfile.read(retired).key_id == old.key_id
        assert not files.staged.exists()
        # No master key on disk in the clear: the files hold ciphertext and public ids only.
        clear = [seal.open_sealed(sealed), seal.open_sealed(retired)]
        for path in (sealed, retired, keyring):
            data = path.read_bytes()
            for raw in clear:
                assert raw not in data
                assert base64.b64encode(raw) not in data

        # The worker that held the old key moves to the new one through the token.
        assert worker.refresh(force=True)
        assert worker.master.key_id == report["master_key_id"]
        _decrypts(worker, before, b"before")
        worker.rotate("payments")  # wrapped under the new key

        # A backup made before restores into another store (the retired sealed key opens it).
        other = FileKeyStore(tmp_path / "other.json")
        initialise(other, files.current())
        target = KeyManager(other, files.current(), lookup=files)
        target.load()
        assert target.restore("payments", backup).latest_version == 2
        _decrypts(target, before, b"before")

        # SIGKILL after the store is committed, before the promotion: the next start finds the
        # store under the staged key, opens it, and finishes the promotion.
        killed = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, timeout=120
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
        staged_id = sealedfile.read(files.staged).key_id
        assert (orjson.loads(keyring.read_bytes()))["master_key_id"] == staged_id
        settings = SealSettings(
            seal="pkcs11",
            pkcs11_module=SOFTHSM_MODULE,
            pkcs11_token_label=token.label,
            pkcs11_pin_file=token.pin_file,
            keyring_file=keyring,
        )
        assert settle_store(settings, FileKeyStore(keyring), seal) == "finished"
        assert files.current().key_id == staged_id
        assert not files.staged.exists()
        restarted = KeyManager(FileKeyStore(keyring), files.current())
        restarted.load()
        _decrypts(restarted, before, b"before")
        assert restarted.keyring.key("payments").latest_version == 3
    finally:
        seal.close()
