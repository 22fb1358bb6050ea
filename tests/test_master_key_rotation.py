"""Master-key rotation (static seal): every version rewrapped under a new master key in one
store transaction, the key file replaced atomically, processes still holding the old key
moving to the new one, backups made before restoring after, and a SIGKILL at each step of a
real rotating process leaving a store that opens with every version readable."""

from __future__ import annotations

import base64
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service import operations
from service.config import SealSettings, decode_master_key
from service.errors import CryptdError, InvalidRequest, KeystoreUnavailable
from service.keys.admin import initialise
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeyStore
from service.seal.rotation import StaticKeyFiles, rotate, settle_store
from service.stores import open_store

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("aes256-gcm", "sm4-gcm", "ed25519", "rsa-2048", "ml-kem-768")


@dataclass
class Deployment:
    settings: SealSettings
    files: StaticKeyFiles
    keystore_url: str | None
    keyring: Path
    ciphertexts: dict[str, list[tuple[int, str]]]  # key -> (version, ciphertext)

    def store(self) -> KeyStore:
        store = open_store(self.keystore_url, self.keyring)
        _OPENED.append(store)
        return store

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
        env.update(
            CRYPTD_SEAL="static",
            CRYPTD_MASTER_KEY_FILE=str(self.files.path),
            CRYPTD_KEYRING_FILE=str(self.keyring),
            PYTHONPATH=str(ROOT),
        )
        if self.keystore_url:
            env["CRYPTD_KEYSTORE_URL"] = self.keystore_url
        return env

    def open(self) -> KeyManager:
        """What a (re)starting worker does: settle, then load with the key file's key."""
        store = self.store()
        settle_store(self.settings, store)
        manager = KeyManager(store, self.files.current(), lookup=self.files)
        manager.load()
        return manager


def _encrypt(manager: KeyManager, name: str, version: int) -> str:
    [result] = operations.run_batch(
        manager.keyring,
        "encrypt",
        name,
        [operations.EncryptItem(b"secret %d" % version, key_version=version)],
    )
    assert not isinstance(result, CryptdError)
    return str(result["ciphertext"])


def check_readable(manager: KeyManager, deployment: Deployment) -> None:
    """Every version of every key unwraps (the load did it) and decrypts what it encrypted."""
    for name, items in deployment.ciphertexts.items():
        for version, ciphertext in items:
            [result] = operations.run_batch(
                manager.keyring, "decrypt", name, [operations.DecryptItem(ciphertext)]
            )
            assert not isinstance(result, CryptdError), result
            assert base64.b64decode(result["plaintext"]) == b"secret %d" % version
    for name in TYPES:
        assert manager.keyring.key(name).latest_version == 3


def make(tmp_path: Path, keystore_url: str | None = None, *, keys: bool = True) -> Deployment:
    tmp_path.mkdir(parents=True, exist_ok=True)
    key_file = tmp_path / "master.key"
    key_file.write_bytes(base64.b64encode(secrets.token_bytes(32)) + b"\n")
    key_file.chmod(0o600)
    keyring = tmp_path / "keyring.json"
    settings = SealSettings(seal="static", master_key_file=key_file, keyring_file=keyring)
    files = StaticKeyFiles(key_file)
    deployment = Deployment(settings, files, keystore_url, keyring, {})
    store = deployment.store()
    if keystore_url:
        from service.keys.pgstore import PostgresKeyStore

        assert isinstance(store, PostgresKeyStore)
        store.create_schema()
    initialise(store, files.current())
    manager = KeyManager(store, files.current(), lookup=files)
    manager.load()
    for name in TYPES if keys else ():
        manager.create(name, name)
        manager.rotate(name)
        manager.rotate(name)
    for name in ("aes256-gcm", "sm4-gcm") if keys else ():
        deployment.ciphertexts[name] = [(v, _encrypt(manager, name, v)) for v in (1, 2, 3)]
    store.close()
    return deployment


_OPENED: list[KeyStore] = []


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No master key from the environment; every store a test opened closed after it."""
    for name in ("CRYPTD_MASTER_KEY", "CRYPTD_MASTER_KEY_FILE", "CRYPTD_SEAL"):
        monkeypatch.delenv(name, raising=False)
    yield
    while _OPENED:
        _OPENED.pop().close()


def _rotation_online(deployment: Deployment) -> None:
    old_key = deployment.files.current()
    # Another worker, started before the rotation, holding the old key.
    other = KeyManager(deployment.store(), old_key, lookup=deployment.files)
    other.load()
    backup = other.backup("aes256-gcm")
    rotator = KeyManager(deployment.store(), old_key, lookup=deployment.files)
    rotator.load()
    report = rotate(deployment.settings, rotator.snapshot)

    new_key = deployment.files.current()
    assert new_key.key_id == report.master_key_id != old_key.key_id
    assert report.previous_master_key_id == old_key.key_id
    assert report.versions == 3 * len(TYPES)
    assert report.keys == len(TYPES)
    assert not deployment.files.staged.exists()
    assert deployment.files.retired.stat().st_mode & 0o777 == 0o600
    assert deployment.files.path.stat().st_mode & 0o777 == 0o600
    raw = deployment.store().read()
    assert raw is not None
    assert raw["master_key_id"] == new_key.key_id
    check_readable(rotator, deployment)

    # The other worker learns of the change, finds the new key by its id, moves to it, and
    # keeps every parsed key (nothing re-parsed: the same handle objects).
    handle = other.keyring.key("rsa-2048").versions[1].handle
    assert other.refresh(force=True)
    assert other.master.key_id == new_key.key_id
    assert other.keyring.key("rsa-2048").versions[1].handle is handle
    check_readable(other, deployment)
    other.rotate("aes256-gcm")  # its changes are wrapped under the new key
    assert rotator.refresh(force=True)
    assert rotator.keyring.key("aes256-gcm").latest_version == 4

    # The old key opens no keyring any more, even with the files to look in.
    stale = KeyManager(deployment.store(), old_key)
    with pytest.raises(Exception, match="master key"):
        stale.load()

    # A backup made before the rotation restores after it (the retired key opens it).
    copy = KeyManager(deployment.store(), new_key, lookup=deployment.files)
    copy.load()
    with pytest.raises(CryptdError):  # the name is taken: nothing changes
        copy.restore("aes256-gcm", backup)
    fresh = make(
        deployment.keyring.parent / "other", keys=False
    )  # another store, same master files
    target = KeyManager(fresh.store(), fresh.files.current(), lookup=deployment.files)
    target.load()
    restored_key = target.restore("aes256-gcm", backup)
    assert restored_key.latest_version == 3
    [result] = operations.run_batch(
        target.keyring,
        "decrypt",
        "aes256-gcm",
        [operations.DecryptItem(deployment.ciphertexts["aes256-gcm"][0][1])],
    )
    assert not isinstance(result, CryptdError)
    assert base64.b64decode(result["plaintext"]) == b"secret 1"

    # Without the retired key the old backup is refused with the reason, and changes nothing.
    deployment.files.retired.unlink()
    with pytest.raises(InvalidRequest, match="made under master key"):
        KeyManager(fresh.store(), fresh.files.current()).restore("x", backup)


def test_rotation_file_store(tmp_path: Path) -> None:
    _rotation_online(make(tmp_path))


@pytest.mark.slow
def test_rotation_postgresql_store(tmp_path: Path, pg_database: str) -> None:
    _rotation_online(make(tmp_path, pg_database))


def test_refused_with_the_key_only_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    deployment = make(tmp_path)
    monkeypatch.setenv("CRYPTD_MASTER_KEY", deployment.files.path.read_text().strip())
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(deployment.keyring))
    before = deployment.keyring.read_bytes()
    from service.cli import main

    assert main(["operator", "rotate-master-key"]) != 0
    assert "CRYPTD_MASTER_KEY: a rotation has nowhere to keep" in capsys.readouterr().err
    assert deployment.keyring.read_bytes() == before
    assert not deployment.files.staged.exists()


def test_a_second_rotation_waits_for_the_first(tmp_path: Path) -> None:
    deployment = make(tmp_path)
    manager = deployment.open()
    store = deployment.store()
    with store.try_lock("master-key-rotation") as held:
        assert held
        with pytest.raises(CryptdError, match="already running"):
            rotate(deployment.settings, manager.snapshot)
    assert not deployment.files.staged.exists()


def test_a_store_under_an_unknown_key_is_refused(tmp_path: Path) -> None:
    deployment = make(tmp_path)
    manager = deployment.open()
    stranger = MasterKey(secrets.token_bytes(32))
    manager.snapshot.rotate_master(stranger)  # as if the new key never reached this host
    other = KeyManager(deployment.store(), deployment.files.current(), lookup=deployment.files)
    with pytest.raises(Exception, match="cannot find"):
        other.load()
    # Nor does a change: the store is refused, nothing is written.
    before = deployment.keyring.read_bytes()
    other.snapshot._keyring = manager.keyring
    with pytest.raises(KeystoreUnavailable):
        other.rotate("aes256-gcm")
    assert deployment.keyring.read_bytes() == before


# Kill points ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from service.fileio import atomic_write as _write
    import service.seal.rotation as rotation

    point = sys.argv[1]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    stage, promote = rotation.StaticKeyFiles.stage, rotation.StaticKeyFiles.promote
    replace = os.replace

    def staged(self, key):
        stage(self, key)
        if point == "staged":
            die()
        if point == "store-write":  # the keyring's temporary file written, not renamed
            os.replace = lambda *a: die()

    def promoting(self):
        if point == "committed":
            die()
        if point == "retired":  # the old key kept, the new one not renamed yet
            calls = []

            def second(*a):
                calls.append(a)
                if len(calls) == 2:
                    die()
                return replace(*a)

            os.replace = second
        promote(self)

    rotation.StaticKeyFiles.stage = staged
    rotation.StaticKeyFiles.promote = promoting
    if point == "store-write" and os.environ.get("CRYPTD_KEYSTORE_URL"):
        import service.keys.pgstore as pg

        original = pg._PgTransaction.write

        def written(self, document):
            original(self, document)
            die()  # every row written, the transaction not committed

        pg._PgTransaction.write = written
        rotation.StaticKeyFiles.stage = stage
    from service.cli import main
    sys.exit(main(["operator", "rotate-master-key"]))
    """
)

POINTS = ("staged", "store-write", "committed", "retired")


def _kill_at(deployment: Deployment, point: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, point],
        env=deployment.env(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]


def _killed_rotations(deployment: Deployment) -> None:
    for point in POINTS:
        before = deployment.files.current().key_id
        _kill_at(deployment, point)
        manager = deployment.open()  # settles the interrupted rotation, then loads
        check_readable(manager, deployment)
        after = deployment.files.current().key_id
        assert manager.master.key_id == after
        assert not deployment.files.staged.exists()
        if point in ("staged", "store-write"):
            assert after == before, point  # rolled back: the store never used the new key
        else:
            assert after != before, point  # finished: the new key promoted
            assert deployment.files.find_retired(before) is not None
        manager.store.close()
    # And a whole rotation goes through afterwards.
    result = subprocess.run(
        [sys.executable, "-m", "service", "operator", "rotate-master-key"],
        env=deployment.env(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    check_readable(deployment.open(), deployment)


@pytest.mark.slow
def test_sigkill_at_each_step_file_store(tmp_path: Path) -> None:
    _killed_rotations(make(tmp_path))


@pytest.mark.slow
def test_sigkill_at_each_step_postgresql_store(tmp_path: Path, pg_database: str) -> None:
    _killed_rotations(make(tmp_path, pg_database))


def test_key_file_decodes(tmp_path: Path) -> None:
    deployment = make(tmp_path)
    manager = deployment.open()
    rotate(deployment.settings, manager.snapshot)
    raw = decode_master_key(deployment.files.path.read_text(), "file")
    assert MasterKey(raw).key_id == manager.master.key_id


def test_an_import_prepared_before_a_rotation_is_wrapped_under_the_new_key(
    tmp_path: Path,
) -> None:
    deployment = make(tmp_path)
    stale = deployment.open()  # holds the old key, and is not told of the rotation
    export = stale.export_key("sm4-gcm")
    rotate(deployment.settings, deployment.open().snapshot)
    imported = stale.import_key(export, name="sm4-copy")
    assert imported.latest_version == 3
    assert stale.master.key_id == deployment.files.current().key_id
    fresh = deployment.open()
    assert fresh.keyring.key("sm4-copy").latest_version == 3
    token = _encrypt(fresh, "sm4-copy", 2)
    [result] = operations.run_batch(
        fresh.keyring, "decrypt", "sm4-copy", [operations.DecryptItem(token)]
    )
    assert not isinstance(result, CryptdError)
    assert base64.b64decode(result["plaintext"]) == b"secret 2"


def test_a_failed_rewrite_leaves_no_staged_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = make(tmp_path)
    manager = deployment.open()
    before = deployment.keyring.read_bytes()
    old = deployment.files.current().key_id

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("service.keys.filestore.atomic_write", full)
    with pytest.raises(KeystoreUnavailable, match="No space left"):
        rotate(deployment.settings, manager.snapshot)
    assert deployment.keyring.read_bytes() == before
    assert not deployment.files.staged.exists()
    assert deployment.files.current().key_id == old == manager.master.key_id
    monkeypatch.undo()
    check_readable(deployment.open(), deployment)


async def test_the_route_refuses_a_key_only_in_the_environment(tmp_path: Path) -> None:
    """In process: the key in CRYPTD_MASTER_KEY (settings.master_key) gives 409 with the
    reason, and the store is left as it was."""
    import httpx
    from pydantic import SecretStr

    from service.api.application import create_app
    from service.auth.clients import generate_secret, write_document
    from service.auth.signature import sign_request
    from service.config import Settings

    deployment = make(tmp_path, keys=False)
    secret = generate_secret()
    write_document(
        tmp_path / "clients.json",
        {
            "clients": {
                "admin": {
                    "secret": secret,
                    "admin": True,
                    "allow": [{"keys": "*", "operations": ["*"]}],
                }
            }
        },
    )
    settings = Settings(
        tls="off",
        master_key=SecretStr(deployment.files.path.read_text().strip()),
        keyring_file=deployment.keyring,
        clients_file=tmp_path / "clients.json",
        audit_log="off",
        docs=False,
    )
    before = deployment.keyring.read_bytes()
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cryptd") as http:
            path = "/v1/sys/rotate-master-key"
            headers = sign_request("POST", path, "", b"", "admin", base64.b64decode(secret))
            answer = await http.post(path, headers=headers)
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "conflict"
    assert "CRYPTD_MASTER_KEY" in answer.json()["error"]["message"]
    assert deployment.keyring.read_bytes() == before
    assert not deployment.files.staged.exists()
