"""The PostgreSQL key store against the real server (a database of each test's own): what it
stores, how a change is one transaction, and every kind of tampering with its rows refused —
never served, never rewritten as valid."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from service.errors import Conflict, KeystoreUnavailable
from service.keys.admin import TargetNotEmpty, copy_keyring, create_keyring_file, initialise
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.pgstore import PostgresKeyStore
from service.keys.store import IntegrityError, KeystoreError, NotInitialised
from service.pgconn import connection_info, describe
from tests.test_keystore_support import (  # noqa: F401 (the fixtures, by name)
    close_stores_fixture,
    master_key_fixture,
    open_store,
)

pytestmark = pytest.mark.slow  # a PostgreSQL database for each test

Rows = dict[str, list[tuple[Any, ...]]]


@pytest.fixture
def store(pg_database: str) -> PostgresKeyStore:
    return open_store(pg_database)


def manager_for(url: str, master: MasterKey, **options: Any) -> KeyManager:
    manager = KeyManager(open_store(url), master, **options)
    manager.load()
    return manager


def sql(url: str, statement: str, params: tuple[Any, ...] = ()) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement, params)


def rows(url: str) -> Rows:
    with psycopg.connect(url) as conn:
        return {
            "keyring": conn.execute("SELECT * FROM cryptd_keyring").fetchall(),
            "keys": conn.execute("SELECT * FROM cryptd_keys ORDER BY name").fetchall(),
            "versions": conn.execute(
                "SELECT * FROM cryptd_key_versions ORDER BY name, version"
            ).fetchall(),
        }


@pytest.fixture
def populated(pg_database: str, master: MasterKey, store: PostgresKeyStore) -> KeyManager:
    initialise(store, master)
    manager = KeyManager(store, master)
    manager.load()
    for name in ("alpha", "beta"):
        manager.create(name, "aes256-gcm")
    manager.rotate("alpha")
    manager.rotate("alpha")
    manager.update("alpha", min_decryption_version=2)
    manager.create("signer", "ed25519", deletion_allowed=True)
    return manager


def test_the_store_holds_the_keyring_as_rows(pg_database: str, populated: KeyManager) -> None:
    stored = rows(pg_database)
    assert [row[0] for row in stored["keys"]] == ["alpha", "beta", "signer"]
    assert [(r[0], r[1]) for r in stored["versions"]] == [
        ("alpha", 1),
        ("alpha", 2),
        ("alpha", 3),
        ("beta", 1),
        ("signer", 1),
    ]
    ((_, schema, fmt, deployment, key_id, generation, mac),) = stored["keyring"]
    assert (schema, fmt, generation) == (1, "cryptd-keyring/2", 7)
    assert key_id == populated._master.key_id
    assert deployment == populated.keyring.deployment_id
    assert len(bytes(mac)) == 32
    # Another process (its own connection) reads the same keyring.
    other = manager_for(pg_database, populated._master)
    assert other.keyring.digest == populated.keyring.digest
    assert other.keyring["alpha"].min_decryption_version == 2
    assert other.keyring["alpha"].latest_version == 3


def test_no_change_writes_nothing(pg_database: str, populated: KeyManager) -> None:
    before = rows(pg_database)
    with pytest.raises(Conflict):
        populated.create("alpha", "aes256-gcm")
    with pytest.raises(Conflict):
        populated.delete("alpha")  # deletion not allowed
    assert rows(pg_database) == before


def test_delete_removes_the_rows(pg_database: str, populated: KeyManager) -> None:
    populated.delete("signer")
    assert "signer" not in populated.keyring
    stored = rows(pg_database)
    assert all(row[0] != "signer" for row in stored["keys"] + stored["versions"])
    populated.create("signer", "ed25519")  # a deleted name may be created again
    assert populated.keyring["signer"].latest_version == 1


def test_concurrent_rotations_on_separate_connections_lose_nothing(
    pg_database: str, populated: KeyManager
) -> None:
    managers = [manager_for(pg_database, populated._master) for _ in range(4)]
    per_manager = 5
    got: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(managers))

    def rotate(manager: KeyManager) -> None:
        barrier.wait()
        for _ in range(per_manager):
            version = manager.rotate("beta").latest_version
            with lock:
                got.append(version)

    threads = [threading.Thread(target=rotate, args=(m,)) for m in managers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = len(managers) * per_manager
    assert sorted(got) == list(range(2, total + 2)), "every rotation got a distinct version"
    fresh = manager_for(pg_database, populated._master)
    assert sorted(fresh.keyring["beta"].versions) == list(range(1, total + 2))


def test_one_process_holds_a_named_lock(pg_database: str) -> None:
    first, second = open_store(pg_database), open_store(pg_database)
    with first.try_lock("rotate") as held:
        assert held
        with second.try_lock("rotate") as other:
            assert not other
        with second.try_lock("something-else") as unrelated:
            assert unrelated
    with second.try_lock("rotate") as after:
        assert after


# Tampering --------------------------------------------------------------------------------


def lower_min_decryption_version(url: str) -> None:
    sql(
        url,
        "UPDATE cryptd_keys SET record = jsonb_set(record, '{min_decryption_version}', '1') "
        "WHERE name = 'alpha'",
    )


def allow_deletion(url: str) -> None:
    sql(
        url,
        "UPDATE cryptd_keys SET record = jsonb_set(record, '{deletion_allowed}', 'true') "
        "WHERE name = 'alpha'",
    )


def move_material_between_keys(url: str) -> None:
    sql(
        url,
        "UPDATE cryptd_key_versions SET material = (SELECT material FROM cryptd_key_versions "
        "WHERE name = 'alpha' AND version = 1) WHERE name = 'beta' AND version = 1",
    )


def swap_versions(url: str) -> None:
    sql(
        url,
        "UPDATE cryptd_key_versions v SET material = o.material FROM cryptd_key_versions o "
        "WHERE v.name = 'alpha' AND o.name = 'alpha' AND v.version + o.version = 3 "
        "AND v.version IN (1, 2)",
    )


def remove_key(url: str) -> None:
    sql(url, "DELETE FROM cryptd_keys WHERE name = 'beta'")


def remove_version(url: str) -> None:
    sql(url, "DELETE FROM cryptd_key_versions WHERE name = 'alpha' AND version = 3")


def add_version(url: str) -> None:
    sql(
        url,
        "INSERT INTO cryptd_key_versions SELECT name, 2, record, material "
        "FROM cryptd_key_versions WHERE name = 'beta' AND version = 1",
    )


def lower_generation(url: str) -> None:
    sql(url, "UPDATE cryptd_keyring SET generation = generation - 1")


def change_type(url: str) -> None:
    sql(
        url,
        "UPDATE cryptd_keys SET record = jsonb_set(record, '{type}', '\"sm4-gcm\"') "
        "WHERE name = 'beta'",
    )


def malformed_record(url: str) -> None:
    sql(url, "UPDATE cryptd_keys SET record = '\"not an object\"'::jsonb WHERE name = 'beta'")


def wrong_field_type(url: str) -> None:
    sql(
        url,
        "UPDATE cryptd_keys SET record = jsonb_set(record, '{min_decryption_version}', '\"2\"') "
        "WHERE name = 'alpha'",
    )


def extra_version_field(url: str) -> None:
    sql(
        url,
        'UPDATE cryptd_key_versions SET record = record || \'{"state": "x"}\'::jsonb '
        "WHERE name = 'beta'",
    )


def truncated_mac(url: str) -> None:
    sql(url, "UPDATE cryptd_keyring SET mac = substring(mac from 1 for 16)")


def newer_schema(url: str) -> None:
    sql(url, "UPDATE cryptd_keyring SET schema_version = 99")


TAMPERING = [
    lower_min_decryption_version,
    allow_deletion,
    move_material_between_keys,
    swap_versions,
    remove_key,
    remove_version,
    add_version,
    lower_generation,
    change_type,
    malformed_record,
    wrong_field_type,
    extra_version_field,
    truncated_mac,
    newer_schema,
]


@pytest.mark.parametrize("tamper", TAMPERING)
def test_tampered_rows_are_refused_and_never_rewritten(
    pg_database: str, populated: KeyManager, tamper: Callable[[str], None]
) -> None:
    served = populated.keyring
    tamper(pg_database)
    tampered = rows(pg_database)

    # A running process keeps serving what it had, and says why it refused the change (the
    # periodic full check, forced here).
    assert populated.refresh(force=True) is False
    assert populated.keyring is served
    assert populated.last_reload_error is not None
    # Every write is refused with 503, and the rows stay exactly as the tampering left them.
    writes: list[Callable[[], object]] = [
        lambda: populated.create("gamma", "aes256-gcm"),
        lambda: populated.rotate("alpha"),
        lambda: populated.update("beta", deletion_allowed=True),
        lambda: populated.delete("signer"),
    ]
    for write in writes:
        with pytest.raises(KeystoreUnavailable) as refused:
            write()
        assert "nothing was changed" in refused.value.message
        assert rows(pg_database) == tampered
    # A process starting now refuses to start on it.
    with pytest.raises(KeystoreError):
        manager_for(pg_database, populated._master)


def test_an_older_snapshot_restored_is_refused_by_a_running_process(
    pg_database: str, populated: KeyManager
) -> None:
    old = rows(pg_database)
    populated.rotate("beta")
    served = populated.keyring

    # Restore the rows as they were (a valid snapshot, MAC and all, one generation older).
    with psycopg.connect(pg_database) as conn:
        conn.execute("DELETE FROM cryptd_keys")
        conn.execute("DELETE FROM cryptd_keyring")
        conn.execute(
            "INSERT INTO cryptd_keyring VALUES (%s, %s, %s, %s, %s, %s, %s)", old["keyring"][0]
        )
        for row in old["keys"]:
            conn.execute(
                "INSERT INTO cryptd_keys VALUES (%s, %s)",
                (row[0], psycopg.types.json.Jsonb(row[1])),
            )
        for row in old["versions"]:
            conn.execute(
                "INSERT INTO cryptd_key_versions VALUES (%s, %s, %s, %s)",
                (row[0], row[1], psycopg.types.json.Jsonb(row[2]), row[3]),
            )
    assert populated.refresh(force=True) is False
    assert populated.keyring is served
    assert "went back" in (populated.last_reload_error or "")
    with pytest.raises(KeystoreUnavailable, match="went back"):
        populated.create("gamma", "aes256-gcm")


def test_another_deployments_database_is_refused(
    pg_database: str, populated: KeyManager, postgres_url: str, tmp_path: Path
) -> None:
    master = populated._master
    # Another deployment under the same master key (a staging copy, say), in a file.
    other = tmp_path / "other.json"
    create_keyring_file(other, master)
    other_manager = KeyManager(FileKeyStore(other), master)
    other_manager.load()
    other_manager.create("alpha", "aes256-gcm")
    for _ in range(10):
        other_manager.rotate("alpha")  # a higher generation than ours
    served = populated.keyring
    # Its content replaces ours in the database.
    sql(pg_database, "DELETE FROM cryptd_keys")
    sql(pg_database, "DELETE FROM cryptd_keyring")
    copy_keyring(FileKeyStore(other), open_store(pg_database), master)
    assert populated.refresh(force=True) is False
    assert populated.keyring is served
    assert "another deployment" in (populated.last_reload_error or "")
    with pytest.raises(KeystoreUnavailable, match="another deployment"):
        populated.rotate("alpha")
    # A process pinned to our deployment refuses to start on it.
    with pytest.raises(IntegrityError, match="CRYPTD_KEYSTORE_ID"):
        manager_for(pg_database, master, expected_deployment=served.deployment_id)


def test_wrong_master_key_is_refused_clearly(pg_database: str, populated: KeyManager) -> None:
    before = rows(pg_database)
    with pytest.raises(IntegrityError, match="master key"):
        manager_for(pg_database, MasterKey(os.urandom(32)))
    assert rows(pg_database) == before


def test_an_empty_database_says_how_to_initialise(pg_database: str, master: MasterKey) -> None:
    with pytest.raises(NotInitialised, match="cryptd keystore init"):
        manager_for(pg_database, master)


def test_init_refuses_a_store_that_holds_a_keyring(pg_database: str, populated: KeyManager) -> None:
    before = rows(pg_database)
    with pytest.raises(TargetNotEmpty):
        initialise(open_store(pg_database), populated._master)
    assert rows(pg_database) == before


def test_copy_from_a_file_moves_wrapped_material_unchanged(
    pg_database: str, tmp_path: Path, master: MasterKey
) -> None:
    path = tmp_path / "keyring.json"
    create_keyring_file(path, master)
    source = KeyManager(FileKeyStore(path), master)
    source.load()
    for type_name in ("aes256-gcm", "rsa-2048", "sm2"):
        source.create(f"k-{type_name}", type_name)
    source.rotate("k-aes256-gcm")
    report = copy_keyring(FileKeyStore(path), open_store(pg_database), master)
    assert (report.keys, report.versions) == (3, 4)
    copied = manager_for(pg_database, master)
    assert copied.keyring.digest == source.keyring.digest  # the same document, MAC and all
    assert copied.keyring.deployment_id == source.keyring.deployment_id
    for name, key in source.keyring.items():
        for number, version in key.versions.items():
            assert copied.keyring[name].versions[number].wrapped == version.wrapped
    # The target now holds a keyring: a second copy is refused, nothing overwritten.
    before = rows(pg_database)
    with pytest.raises(TargetNotEmpty):
        copy_keyring(FileKeyStore(path), open_store(pg_database), master)
    assert rows(pg_database) == before


def test_database_down_is_unavailable_not_an_error(master: MasterKey) -> None:
    from tests.conftest import free_port

    store = open_store(f"postgresql://postgres@127.0.0.1:{free_port()}/none")
    with pytest.raises(KeystoreError) as caught:
        store.stamp()
    assert "unreachable" in str(caught.value)


def test_url_parameters_pass_through_to_libpq() -> None:
    info = connection_info(
        "postgresql://cryptd:s3cret@db.example:6432/keys?sslmode=verify-full"
        "&sslrootcert=/etc/ca.pem&connect_timeout=2"
    )
    params = psycopg.conninfo.conninfo_to_dict(info)
    assert params["sslmode"] == "verify-full"
    assert params["sslrootcert"] == "/etc/ca.pem"
    assert params["connect_timeout"] == "2"  # the URL wins over the default
    assert params["application_name"] == "cryptd"
    assert "s3cret" not in describe(info)
    assert describe(info) == "postgresql cryptd@db.example:6432/keys"


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("postgresql://cryptd@db.internal/cryptd", True),
        ("postgresql://cryptd@db.internal/cryptd?sslmode=prefer", True),
        ("postgresql://cryptd@db.internal/cryptd?sslmode=verify-full", False),
        ("postgresql://cryptd@db.internal/cryptd?sslmode=disable", False),  # an explicit choice
        ("postgresql://cryptd@127.0.0.1/cryptd", False),
        ("postgresql:///cryptd?host=/var/run/postgresql", False),
        ("mysql://db/cryptd", True),
    ],
)
def test_production_refuses_a_remote_store_without_tls_verification(
    monkeypatch: pytest.MonkeyPatch, url: str, refused: bool
) -> None:
    from pydantic import ValidationError

    from service.config import Settings

    monkeypatch.delenv("PGSSLMODE", raising=False)
    options: dict[str, Any] = {
        "env": "production",
        "master_key": "x" * 44,
        "clients_file": "clients.json",
        "keystore_url": url,
        "tls": "off",  # the listener's TLS is not what this test is about
    }
    if refused:
        with pytest.raises(ValidationError, match="CRYPTD_KEYSTORE_URL"):
            Settings(**options)
    else:
        assert Settings(**options).keystore_url_value() == url
