"""Key states in the key stores: authenticated like every other field in the keyring file and
in PostgreSQL (a hand edit is refused, never served, never rewritten), keyrings from before
states still load (and stay as they were written until a key uses a state), the document's
rules between the fields, and the scheduled destruction: one process, re-checked inside its
transaction."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from service import operations
from service.errors import KeyDisabled, KeyNotFound
from service.keys.admin import create_keyring_file, initialise
from service.keys.document import KeyRecord, MalformedDocument
from service.keys.filestore import FileKeyStore
from service.keys.keyring import parse_time
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeyStore, KeystoreError

pytestmark = pytest.mark.slow  # a PostgreSQL database for each test

# docs/FORMAT.md section 6, "Vector": a keyring written before key states existed.
VECTOR_MASTER = bytes.fromhex("202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f")
VECTOR_KEYRING = {
    "format": "cryptd-keyring/1",
    "master_key_id": "5db3f5c4332e82e1",
    "keys": {
        "doc-aes": {
            "type": "aes256-gcm",
            "created_at": "2025-01-01T00:00:00Z",
            "min_decryption_version": 1,
            "deletion_allowed": False,
            "versions": [
                {
                    "version": 1,
                    "created_at": "2025-01-01T00:00:00Z",
                    "material": "EBESExQVFhcYGRobINz9EUtGFIF7US0v2MWuLn2cxkshHREFuCNc+JDVnPSgdy"
                    "ldNHqAk6baE9nADPzR",
                }
            ],
        }
    },
    "mac": "kBI/r1hyy7NeE9AYXxRh8o9U06rkgJJiQfR0dKnFUiI=",
}
NEW_FIELDS = {"state", "min_encryption_version", "deletion_date", "state_before_deletion"}


def test_a_keyring_from_before_states_loads_with_every_key_enabled(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    path.write_bytes(orjson.dumps(VECTOR_KEYRING))
    manager = KeyManager(FileKeyStore(path), MasterKey(VECTOR_MASTER))
    key = manager.load().key("doc-aes")
    assert (key.state, key.min_encryption_version, key.deletion_date) == ("enabled", 0, None)
    assert key.metadata()["state"] == "enabled"
    item = operations.EncryptItem(b"still works")
    (result,) = operations.run_batch(manager.keyring, "encrypt", "doc-aes", [item])
    assert not isinstance(result, Exception)
    # A change elsewhere rewrites the document; the old key's record gains no field.
    manager.create("fresh", "aes256-gcm")
    stored = orjson.loads(path.read_bytes())["keys"]
    assert not NEW_FIELDS & set(stored["doc-aes"])
    assert not NEW_FIELDS & set(stored["fresh"])
    manager.update("doc-aes", state="decrypt_only")
    assert orjson.loads(path.read_bytes())["keys"]["doc-aes"]["state"] == "decrypt_only"
    again = KeyManager(FileKeyStore(path), MasterKey(VECTOR_MASTER))
    assert again.load()["doc-aes"].state == "decrypt_only"
    manager.update("doc-aes", state="enabled")
    assert "state" not in orjson.loads(path.read_bytes())["keys"]["doc-aes"]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"state": "retired"}, "unknown state"),
        ({"state": 1}, "must be of type str"),
        ({"state": "pending_deletion"}, "go with pending_deletion"),
        ({"deletion_date": "2030-01-01T00:00:00Z"}, "go with pending_deletion"),
        (
            {
                "state": "pending_deletion",
                "deletion_date": "2030-01-01T00:00:00Z",
                "state_before_deletion": "pending_deletion",
            },
            "not a state to restore",
        ),
        (
            {
                "state": "pending_deletion",
                "deletion_date": "tomorrow",
                "state_before_deletion": "enabled",
            },
            "not an RFC 3339",
        ),
        ({"min_encryption_version": 3}, "min_encryption_version out of range"),
        ({"min_encryption_version": -1}, "min_encryption_version out of range"),
    ],
)
def test_records_breaking_the_rules_between_fields_are_malformed(
    fields: dict[str, Any], reason: str
) -> None:
    record = {
        "type": "aes256-gcm",
        "created_at": "2025-01-01T00:00:00Z",
        "min_decryption_version": 1,
        "versions": [
            {"version": v, "created_at": "2025-01-01T00:00:00Z", "material": "AA=="} for v in (1, 2)
        ],
    }
    with pytest.raises(MalformedDocument, match=reason):
        KeyRecord.from_json({**record, **fields}, "key 'k'")
    pending = {
        "state": "pending_deletion",
        "deletion_date": "2030-01-01T00:00:00Z",
        "state_before_deletion": "disabled",
        "min_encryption_version": 2,
    }
    assert KeyRecord.from_json({**record, **pending}, "key 'k'").state == "pending_deletion"


# Both stores -------------------------------------------------------------------------------


class Store:
    """A populated store and a way to edit what it holds without the master key."""

    def __init__(
        self, store: KeyStore, edit: Callable[[str, Callable[[dict[str, Any]], None]], None]
    ):
        self.store = store
        self.edit = edit  # edit(key name, change of its record as stored)


def _file_store(tmp_path: Path) -> Iterator[Store]:
    path = tmp_path / "keyring.json"

    def edit(name: str, change: Callable[[dict[str, Any]], None]) -> None:
        document = orjson.loads(path.read_bytes())
        change(document["keys"][name])
        path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))

    yield Store(FileKeyStore(path), edit)


def _pg_store(url: str) -> Iterator[Store]:
    import psycopg
    from psycopg.types.json import Jsonb

    from service.keys.pgstore import PostgresKeyStore

    store = PostgresKeyStore(url)

    def edit(name: str, change: Callable[[dict[str, Any]], None]) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT record FROM cryptd_keys WHERE name = %s", (name,))
            (record,) = row.fetchone() or (None,)
            assert isinstance(record, dict)
            change(record)
            conn.execute(
                "UPDATE cryptd_keys SET record = %s WHERE name = %s", (Jsonb(record), name)
            )

    try:
        yield Store(store, edit)
    finally:
        store.close()


@pytest.fixture(params=["file", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "file":
        yield from _file_store(tmp_path)
    else:
        yield from _pg_store(request.getfixturevalue("pg_database"))


@pytest.fixture
def master() -> MasterKey:
    return MasterKey(os.urandom(32))


def populated(backend: Store, master: MasterKey, **options: Any) -> KeyManager:
    initialise(backend.store, master)
    manager = KeyManager(backend.store, master, deletion_waiting_period=3600, **options)
    manager.load()
    manager.create("retired", "aes256-gcm")
    manager.rotate("retired")
    manager.update("retired", state="disabled", min_encryption_version=2)
    manager.create("leaving", "aes256-gcm", deletion_allowed=True)
    manager.update("leaving", state="decrypt_only")
    manager.delete("leaving")
    return manager


def _enable(record: dict[str, Any]) -> None:
    record["state"] = "enabled"


def _drop_state(record: dict[str, Any]) -> None:
    del record["state"]  # what a keyring without the field means: enabled


def _lower_floor(record: dict[str, Any]) -> None:
    del record["min_encryption_version"]


def _bring_date_forward(record: dict[str, Any]) -> None:
    record["deletion_date"] = "2000-01-01T00:00:00Z"


def _cancel_by_hand(record: dict[str, Any]) -> None:
    record["state"] = record.pop("state_before_deletion")
    del record["deletion_date"]


def _restore_as_enabled(record: dict[str, Any]) -> None:
    record["state_before_deletion"] = "enabled"


TAMPERING = [
    ("retired", _enable),
    ("retired", _drop_state),
    ("retired", _lower_floor),
    ("leaving", _bring_date_forward),
    ("leaving", _cancel_by_hand),
    ("leaving", _restore_as_enabled),
]


@pytest.mark.parametrize(("name", "tamper"), TAMPERING, ids=[t.__name__ for _, t in TAMPERING])
def test_states_edited_by_hand_are_refused(
    backend: Store, master: MasterKey, name: str, tamper: Callable[[dict[str, Any]], None]
) -> None:
    manager = populated(backend, master)
    served = manager.keyring
    before = backend.store.read()
    backend.edit(name, tamper)
    tampered = backend.store.read()
    assert tampered != before
    # The running process keeps what it verified, and says why it refused the store.
    assert manager.refresh(force=True) is False
    assert manager.keyring is served
    assert manager.last_reload_error is not None
    assert "integrity check failed" in manager.last_reload_error
    assert served["retired"].state == "disabled"
    assert served["leaving"].state == "pending_deletion"
    # Nothing is written over it: not a change, not the scheduled destruction.
    with pytest.raises(Exception, match="nothing was changed"):
        manager.update("retired", deletion_allowed=True)
    assert manager.run_due() == ([], [])
    assert backend.store.read() == tampered
    # A process starting now refuses it.
    with pytest.raises(KeystoreError):
        KeyManager(backend.store, master).load()


def test_states_survive_a_reload_in_another_process(backend: Store, master: MasterKey) -> None:
    populated(backend, master)
    other = KeyManager(backend.store, master)
    keyring = other.load()
    retired, leaving = keyring["retired"], keyring["leaving"]
    assert (retired.state, retired.min_encryption_version) == ("disabled", 2)
    assert leaving.state == "pending_deletion"
    assert leaving.deletion_date is not None
    with pytest.raises(KeyDisabled, match="'retired' is disabled: decrypt is refused"):
        operations.check_operation(retired, "decrypt")
    with pytest.raises(KeyDisabled, match="pending_deletion: verify is refused"):
        leaving.check_use("verify")
    restored = other.cancel_deletion("leaving")
    assert (restored.state, restored.deletion_date) == ("decrypt_only", None)


def test_destruction_happens_once_in_one_process_and_spares_a_cancelled_key(
    backend: Store, master: MasterKey
) -> None:
    initialise(backend.store, master)
    destroyed: list[tuple[str, str]] = []
    first = KeyManager(
        backend.store,
        master,
        deletion_waiting_period=1,
        on_destroy=lambda name, date: destroyed.append((name, date)),
    )
    first.load()
    for name in ("gone", "kept"):
        first.create(name, "aes256-gcm", deletion_allowed=True)
        first.delete(name)
    second = KeyManager(backend.store, master, deletion_waiting_period=1)
    second.load()
    assert first.due_for_destruction() == []
    second.cancel_deletion("kept")  # the first process's snapshot still has it pending
    deadline = time.time() + 5
    # Their dates may be a second apart (rounded up to the second each was scheduled in).
    while len(first.due_for_destruction()) < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert first.due_for_destruction() == ["gone", "kept"]
    with pytest.raises(KeyNotFound):
        first.keyring.key("gone")  # past the date: never served, destroyed or not
    with backend.store.try_lock("rotate") as held:
        assert held
        assert first.run_due() == ([], [])  # another process holds the scheduling lock
    assert first.run_due() == ([], ["gone"])
    assert [name for name, _ in destroyed] == ["gone"]
    assert set(first.keyring) == {"kept"}
    assert first.keyring["kept"].state == "enabled"
    assert second.run_due() == ([], [])
    stored = backend.store.read()
    assert stored is not None
    assert set(stored["keys"]) == {"kept"}


def test_automatic_rotation_skips_keys_that_are_not_enabled(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    master = MasterKey(os.urandom(32))
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master, min_auto_rotate_period=1)
    manager.load()
    for name, state in (("on", "enabled"), ("ro", "decrypt_only"), ("off", "disabled")):
        manager.create(name, "aes256-gcm", auto_rotate_period=1)
        if state != "enabled":
            manager.update(name, state=state)
    time.sleep(2.1)
    assert manager.due_for_rotation() == ["on"]
    assert manager.rotate_due() == [("on", 2)]
    assert manager.keyring["ro"].latest_version == 1


def test_a_key_past_its_date_cannot_be_backed_up_or_rotated(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    master = MasterKey(os.urandom(32))
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master, deletion_waiting_period=1)
    manager.load()
    manager.create("k", "ed25519", deletion_allowed=True)
    pending = manager.delete("k")
    assert pending is not None
    assert pending.state == "pending_deletion"
    with pytest.raises(KeyDisabled):
        manager.backup("k")
    with pytest.raises(KeyDisabled):
        manager.rotate("k")
    time.sleep(2.1)
    for action in (lambda: manager.backup("k"), lambda: manager.rotate("k")):
        with pytest.raises(KeyNotFound):
            action()


def test_cryptd_keys_manages_states_and_deletion_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """For a keyring no service writes (a Secret): the same rules from the command line."""
    import json

    from service.cli import main

    (tmp_path / "master.key").write_text(base64.b64encode(os.urandom(32)).decode())
    monkeypatch.setenv("CRYPTD_MASTER_KEY_FILE", str(tmp_path / "master.key"))
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(tmp_path / "keyring.json"))
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    monkeypatch.delenv("CRYPTD_ENV", raising=False)
    monkeypatch.delenv("CRYPTD_DELETION_WAITING_PERIOD", raising=False)

    def run(*args: str) -> Any:
        assert main(["keys", *args]) == 0
        return json.loads(capsys.readouterr().out)

    run("create", "old", "--type", "aes256-gcm", "--deletion-allowed")
    run("rotate", "old")
    updated = run("update", "old", "--state", "decrypt_only", "--min-encryption-version", "2")
    assert (updated["state"], updated["min_encryption_version"]) == ("decrypt_only", 2)
    assert run("list")["keys"][0]["state"] == "decrypt_only"
    # Production's default waiting period: seven days.
    pending = run("delete", "old")
    assert pending["state"] == "pending_deletion"
    assert parse_time(pending["deletion_date"]) - time.time() > 7 * 86400 - 60
    assert run("cancel-deletion", "old")["state"] == "decrypt_only"
    run("delete", "old", "--waiting-period", "1")
    assert run("destroy-due") == {"destroyed": []}
    time.sleep(2.1)
    assert run("list") == {"keys": []}  # past its date: not listed, before it is destroyed
    assert "old" in orjson.loads((tmp_path / "keyring.json").read_bytes())["keys"]
    assert run("destroy-due") == {"destroyed": ["old"]}
    assert orjson.loads((tmp_path / "keyring.json").read_bytes())["keys"] == {}
    run("create", "now", "--type", "sm4-gcm", "--deletion-allowed")
    assert run("delete", "now", "--waiting-period", "0") == {"deleted": "now"}


def test_a_backup_keeps_the_state_and_the_floor(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    master = MasterKey(os.urandom(32))
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master)
    manager.load()
    manager.create("k", "aes256-gcm", deletion_allowed=True)
    manager.rotate("k")
    manager.update("k", state="decrypt_only", min_encryption_version=2)
    blob = manager.backup("k")
    assert manager.delete("k") is None  # no waiting period here: deleted at once
    restored = manager.restore("k", blob)
    assert (restored.state, restored.min_encryption_version) == ("decrypt_only", 2)
    with pytest.raises(KeyDisabled, match="decrypt_only: encrypt is refused"):
        restored.check_use("encrypt")
