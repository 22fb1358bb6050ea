"""A change read through the rows it wrote (service/keys/snapshot.py, PostgreSQL): the commit's
notification names the keys it wrote, a reader reads the header and those rows only, and
serves the result only when the MAC over the whole document verifies; otherwise it reads
everything, exactly as a full refresh does. Rows read are counted by the store, never timed."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from service.keys.admin import initialise
from service.keys.document import KeyRecord, KeyringDocument, utc_now
from service.keys.keyring import DISABLED, ENABLED
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.pgstore import (
    CHANNEL,
    NOTICE_NAMES_BYTES,
    PostgresKeyStore,
    notice_payload,
    parse_notice,
)
from service.keys.records import wrap_version
from service.keys.store import Changed
from service.keys.watch import KeyringWatcher
from tests.test_keystore_support import (  # noqa: F401 (the fixtures, by name)
    close_stores_fixture,
    master_key_fixture,
    open_store,
    wait_for,
)

pytestmark = pytest.mark.slow  # a PostgreSQL database for each test

KEYS = 12


def manager_for(url: str, master: MasterKey) -> KeyManager:
    store = open_store(url)
    manager = KeyManager(store, master)
    manager.load()
    return manager


def rows_read(manager: KeyManager) -> int:
    store = manager.store
    assert isinstance(store, PostgresKeyStore)
    return store.rows_read


def total_rows(manager: KeyManager) -> int:
    return sum(1 + len(key.versions) for key in manager.keyring.values())


@pytest.fixture
def pair(pg_database: str, master: MasterKey) -> tuple[KeyManager, KeyManager]:
    """A writer holding KEYS keys (k00 of three versions, the rest of one) and a reader
    that loaded them, on connections of their own."""
    store = open_store(pg_database)
    initialise(store, master)
    writer = KeyManager(store, master)
    writer.load()
    for n in range(KEYS):
        writer.create(f"k{n:02d}", "aes256-gcm", deletion_allowed=True)
    writer.rotate("k00")
    writer.rotate("k00")
    return writer, manager_for(pg_database, master)


def notified(url: str, change: Callable[[], object]) -> Changed:
    """The notification ``change``'s commit sends, as a reader's listener parses it."""
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        change()
        heard = list(listener.notifies(timeout=10, stop_after=1))
    assert len(heard) == 1
    notice = parse_notice(heard[0].channel, heard[0].payload)
    assert isinstance(notice, Changed)
    return notice


def sql(url: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)


CHANGES: dict[str, tuple[Callable[[KeyManager], object], str, int]] = {
    # what the writer does, the key it names, the rows the reader then reads (key + versions)
    "state": (lambda w: w.update("k03", state=DISABLED), "k03", 2),
    "new version": (lambda w: w.rotate("k00"), "k00", 5),
    "min_decryption_version": (lambda w: w.update("k00", min_decryption_version=2), "k00", 4),
    "deleted key": (lambda w: w.delete("k05"), "k05", 0),
    "new key": (lambda w: w.create("fresh", "ed25519"), "fresh", 2),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_change_costs_the_reader_only_the_rows_it_wrote(
    pg_database: str, pair: tuple[KeyManager, KeyManager], case: str
) -> None:
    writer, reader = pair
    change, name, expected_rows = CHANGES[case]
    before = reader.keyring
    notice = notified(pg_database, lambda: change(writer))
    assert notice == Changed(writer.keyring.generation, frozenset({name}))

    read_before = rows_read(reader)
    reader.heard(notice)
    assert reader.refresh() is True
    assert rows_read(reader) - read_before == expected_rows  # only the named key's rows
    # Exactly what the writer committed (the same verified content), and nothing refused.
    assert reader.keyring.digest == writer.keyring.digest
    assert reader.keyring.generation == writer.keyring.generation
    assert reader.last_reload_error is None
    assert (name in reader.keyring) == (name in writer.keyring)
    if name in writer.keyring:
        assert reader.keyring[name].state == writer.keyring[name].state
        assert sorted(reader.keyring[name].versions) == sorted(writer.keyring[name].versions)
    # The keys it did not read are the very objects served before (not parsed, not built).
    for other in before:
        if other != name:
            assert reader.keyring[other] is before[other]
    # A full read agrees: the patched document is the stored one.
    assert reader.refresh(force=True) is False
    assert reader.keyring.digest == writer.keyring.digest


def test_several_changes_heard_are_read_together(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    writer, reader = pair
    notices = [
        notified(pg_database, lambda: writer.update("k01", state=DISABLED)),
        notified(pg_database, lambda: writer.rotate("k02")),
        notified(pg_database, lambda: writer.update("k01", state=ENABLED)),
    ]
    read_before = rows_read(reader)
    for notice in notices:
        reader.heard(notice)
    assert reader.refresh() is True
    assert rows_read(reader) - read_before == 2 + 3  # k01 (one version), k02 (two)
    assert reader.keyring.digest == writer.keyring.digest


def test_a_change_not_heard_of_is_read_whole(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    writer, reader = pair
    first = notified(pg_database, lambda: writer.update("k01", state=DISABLED))
    writer.update("k02", state=DISABLED)  # its notification is lost
    read_before = rows_read(reader)
    reader.heard(first)
    assert reader.refresh() is True
    # k01's rows, then (the header's generation is one not heard of) everything.
    assert rows_read(reader) - read_before == 2 + total_rows(writer)
    assert reader.keyring["k02"].state == DISABLED
    assert reader.keyring.digest == writer.keyring.digest


def test_a_check_no_notification_started_reads_everything_once(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    """The periodic check, a store without notifications: one full read, no partial one."""
    writer, reader = pair
    writer.update("k02", state=DISABLED)
    read_before = rows_read(reader)
    assert reader.refresh() is True
    assert rows_read(reader) - read_before == total_rows(writer)
    assert reader.keyring.digest == writer.keyring.digest


def test_a_notice_naming_the_wrong_keys_fails_the_mac_and_is_read_whole(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    """A notice that does not name a key the change wrote (a writer's bug, a forged
    notification): the patched document does not verify, so it is never served; the full
    read serves what is stored."""
    writer, reader = pair
    writer.update("k04", state=DISABLED)
    read_before = rows_read(reader)
    reader.heard(Changed(writer.keyring.generation, frozenset({"k01"})))
    assert reader.refresh() is True
    assert rows_read(reader) - read_before == 2 + total_rows(writer)  # k01, then everything
    assert reader.keyring["k04"].state == DISABLED
    assert reader.keyring.digest == writer.keyring.digest
    assert reader.last_reload_error is None


def test_a_tampered_row_named_in_a_notice_is_refused(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    """The revocation case: a key is disabled, and its row is set back to enabled before the
    reader reads it. Neither the partial nor the full read verifies: the reader keeps the
    snapshot it served and says why."""
    writer, reader = pair
    served = reader.keyring
    notice = notified(pg_database, lambda: writer.update("k03", state=DISABLED))
    sql(pg_database, "UPDATE cryptd_keys SET record = record - 'state' WHERE name = 'k03'")
    reader.heard(notice)
    assert reader.refresh() is False
    assert reader.keyring is served
    assert "integrity check failed" in (reader.last_reload_error or "")
    # Never served unverified: the key the writer disabled is not enabled by the tampering
    # either; the reader refuses the store until it verifies again.
    assert reader.refresh(force=True) is False
    assert reader.keyring is served


def test_a_row_changed_without_a_notification_is_caught_by_the_full_check(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    """A row changed behind the store's back, not named by any notice: the partial read
    puts the reader's own verified copy of that key beside the named rows, so what it serves
    is what the writer sealed (the MAC verifies over it), never the tampered row; the
    periodic full read then refuses the store."""
    writer, reader = pair
    notice = notified(pg_database, lambda: writer.update("k07", state=DISABLED))
    sql(
        pg_database,
        "UPDATE cryptd_keys SET record = jsonb_set(record, '{deletion_allowed}', 'false') "
        "WHERE name = 'k06'",
    )
    reader.heard(notice)
    assert reader.refresh() is True
    assert reader.keyring["k07"].state == DISABLED
    assert reader.keyring["k06"].deletion_allowed is True  # as sealed, not as tampered
    assert reader.keyring.digest == writer.keyring.digest
    served = reader.keyring
    reader.snapshot._verified_at = float("-inf")  # the periodic full check is due
    assert reader.refresh() is False
    assert reader.keyring is served
    assert "integrity check failed" in (reader.last_reload_error or "")


def test_a_change_of_many_keys_says_everything_and_is_read_whole(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    writer, reader = pair
    master = writer.master
    long_names = [f"bulk-{n:03d}-" + "x" * 100 for n in range(80)]

    def bulk(document: KeyringDocument) -> None:
        for name in long_names:
            material = os.urandom(32)
            versions = [wrap_version(master, name, "aes256-gcm", 1, material)]
            document.keys[name] = KeyRecord("aes256-gcm", utc_now(), versions)

    notice = notified(pg_database, lambda: writer.snapshot.apply(bulk))
    assert notice == Changed(writer.keyring.generation, None)  # too many names to list
    read_before = rows_read(reader)
    reader.heard(notice)
    assert reader.refresh() is True
    assert rows_read(reader) - read_before == total_rows(writer)
    assert reader.keyring.digest == writer.keyring.digest
    assert len(reader.keyring) == KEYS + len(long_names)


def test_notification_payloads() -> None:
    assert notice_payload(17, {"b", "a"}) == "17 keys a b"
    assert parse_notice(CHANNEL, "17 keys a b") == Changed(17, frozenset({"a", "b"}))
    assert parse_notice(CHANNEL, notice_payload(9, set())) == Changed(9, frozenset())
    # More than fit: the generation alone, read as "everything".
    many = {f"{n:04d}" + "x" * 120 for n in range(NOTICE_NAMES_BYTES // 100)}
    assert notice_payload(3, many) == "3"
    assert parse_notice(CHANNEL, "3") == Changed(3, None)
    # A name no key can have, or words out of place: the generation only, never the names.
    assert parse_notice(CHANNEL, "4 keys a b/c") == Changed(4, None)
    # The service's own keys (the audit signing key) are named like any other.
    assert parse_notice(CHANNEL, "5 keys cryptd:audit-signing") == Changed(
        5, frozenset({"cryptd:audit-signing"})
    )
    assert parse_notice(CHANNEL, "4 names a") == Changed(4, None)
    assert parse_notice(CHANNEL, "x keys a") == Changed(None)


async def test_a_worker_hears_a_change_and_reads_only_its_rows(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    """Through the watcher's LISTEN, as a server worker does."""
    writer, reader = pair
    watcher = KeyringWatcher(reader, interval=3600)
    watcher.start()
    try:
        await wait(lambda: _listening(pg_database))
        read_before = rows_read(reader)
        await asyncio.to_thread(writer.update, "k09", state=DISABLED)
        await wait(lambda: reader.keyring.generation == writer.keyring.generation)
        assert reader.keyring["k09"].state == DISABLED
        assert rows_read(reader) - read_before == 2
    finally:
        await watcher.close()


def _listening(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row: Any = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN%%'"
        ).fetchone()
    return bool(row and row[0])


async def wait(predicate: Callable[[], bool]) -> None:
    await asyncio.to_thread(wait_for, predicate)  # the event loop stays free for the watcher


def test_the_committing_worker_checks_its_own_change_without_reading_the_rows(
    pg_database: str, pair: tuple[KeyManager, KeyManager]
) -> None:
    """The committing worker hears its own change's notification too, and its check comes
    after the commit: the header alone says the store holds what it serves (no row read). A
    change committed meanwhile by another writer, not heard of, is still read whole."""
    writer, other = pair
    notice = notified(pg_database, lambda: writer.update("k03", state=DISABLED))
    served = writer.keyring
    read_before = rows_read(writer)
    writer.heard(notice)
    assert writer.refresh() is False
    assert rows_read(writer) == read_before
    assert writer.keyring is served
    assert writer.last_reload_error is None

    # Once only: the next change of its own, then another writer's it did not hear of.
    notice = notified(pg_database, lambda: writer.update("k04", state=DISABLED))
    writer.heard(notice)
    other.refresh()
    other.update("k05", state=DISABLED)
    read_before = rows_read(writer)
    assert writer.refresh() is True
    assert rows_read(writer) - read_before == total_rows(writer)  # whole
    assert writer.keyring.digest == other.keyring.digest
