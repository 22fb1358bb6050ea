"""The usage recorder over the real SQLite store: counts kept through a store outage and stored
exactly once, ``last_used_at`` from the time of the cut, key incarnations apart, and the cap on
labelled keys shared by processes through its file."""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from service.keys.admin import initialise
from service.keys.filestore import FileKeyStore
from service.keys.keyring import Keyring
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.pgstore import PostgresKeyStore
from service.metrics.labels import KeyLabels
from service.operations import MacVerifyItem, RewrapItem, VerifyItem
from service.usage.postgres import PostgresUsageStore
from service.usage.recorder import UsageRecorder, as_json
from service.usage.sqlite import SqliteUsageStore
from service.usage.store import UsageRow, UsageUnavailable


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    master = MasterKey(bytes(range(32)))
    store = FileKeyStore(tmp_path / "keyring.json")
    initialise(store, master)
    manager = KeyManager(store, master)
    manager.load()
    manager.create("a", "aes256-gcm")
    manager.rotate("a")
    manager.create("b", "hmac-sha256")
    manager.create("s", "ed25519")
    return manager.keyring


def stored(path: Path) -> list[UsageRow]:
    store = SqliteUsageStore(path)
    try:
        return store.read_all()
    finally:
        store.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_counts_survive_an_outage_and_are_stored_once(tmp_path: Path, keyring: Keyring) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    outcomes: list[bool] = []
    clock = Clock()
    recorder = UsageRecorder(
        SqliteUsageStore(blocked / "usage.sqlite"), on_flush=outcomes.append, clock=clock
    )
    key = keyring["a"]

    async def scenario() -> None:
        for _ in range(3):
            recorder.record(keyring, key, "encrypt", [None], [{"key_version": 2}])
        await recorder.flush()  # fails: kept
        clock.now += 5
        recorder.record(keyring, key, "encrypt", [None], [{"key_version": 2}])
        recorder.record(keyring, key, "decrypt", [None, None], [{"key_version": 1}, ValueError()])
        await recorder.flush()  # fails again: one merged batch retried
        assert await recorder.usage(key) is None  # unreadable: unknown, not zero
        assert len(recorder._pending) == 1
        recorder.store = SqliteUsageStore(tmp_path / "usage.sqlite")
        clock.now += 5
        await recorder.flush()
        await recorder.flush()  # nothing new: nothing written again
        usage = await recorder.usage(key)
        assert usage is not None
        assert usage[2]["operations"]["encrypt"] == 4
        assert usage[1]["operations"]["decrypt"] == 1  # the failed item is not counted
        assert usage[2]["last_used_at"] == 1_800_000_005.0  # the second cut's time
        assert as_json(usage[1])["last_used_at"] == "2027-01-15T08:00:05Z"
        await recorder.close()

    asyncio.run(scenario())
    assert outcomes == [False, False, True]
    rows = stored(tmp_path / "usage.sqlite")
    assert sorted((r.version, r.operation, r.count) for r in rows) == [
        (1, "decrypt", 1),
        (2, "encrypt", 4),
    ]


def test_counts_a_last_flush_cannot_store_are_reported_lost(
    tmp_path: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    recorder = UsageRecorder(SqliteUsageStore(blocked / "usage.sqlite"))
    key = keyring["a"]

    async def scenario() -> None:
        for _ in range(3):
            recorder.record(keyring, key, "encrypt", [None], [{"key_version": 2}])
        await recorder.flush()  # fails: kept for the next flush
        recorder.record(keyring, key, "sign", [None], [{"key_version": 2}])
        await recorder.close()  # the last flush fails too: nothing will retry them

    with caplog.at_level("ERROR", logger="cryptd.usage"):
        asyncio.run(scenario())
    (lost,) = [r for r in caplog.records if r.getMessage() == "usage counts lost at shutdown"]
    assert lost.operations == 4  # type: ignore[attr-defined]


def test_unflushed_counts_show_at_once_and_incarnations_stay_apart(
    tmp_path: Path, keyring: Keyring
) -> None:
    store = SqliteUsageStore(tmp_path / "usage.sqlite")
    recorder = UsageRecorder(store)
    key = keyring["a"]
    # A key of the same name deleted before (another created_at): its rows are not this key's.
    store.add({("a", "2020-01-01T00:00:00Z", 1, "encrypt"): (99, 1.0)})

    async def scenario() -> None:
        recorder.record(keyring, key, "encrypt", [None], [{"key_version": 1}])
        usage = await recorder.usage(key)
        assert usage is not None
        assert usage[1]["operations"]["encrypt"] == 1  # not flushed yet, shown
        assert usage[1]["last_used_at"] is not None
        await recorder.close()

    asyncio.run(scenario())
    rows = [r for r in store.read_all() if r.key_created == key.created_at]
    assert [(r.version, r.operation, r.count) for r in rows] == [(1, "encrypt", 1)]


def test_each_operation_counts_on_the_version_it_used(keyring: Keyring) -> None:
    recorder = UsageRecorder(None)
    a, b, s = keyring["a"], keyring["b"], keyring["s"]
    recorder.record(
        keyring,
        a,
        "rewrap",
        [RewrapItem("cryptd:v1:AQE"), RewrapItem("cryptd:v2:AQE", to_key="b")],
        [{"key_version": 2}, {"key_version": 1}],
    )
    recorder.record(
        keyring,
        s,
        "verify",
        [VerifyItem(b"sig", b"m"), VerifyItem(b"sig", b"m")],
        [{"valid": False}, InterruptedError()],
    )
    recorder.record(
        keyring, b, "verify", [MacVerifyItem("cryptd:v1:AAAA", b"m")], [{"valid": True}]
    )
    assert recorder._counts == {
        ("a", a.created_at, 1, "rewrap_from"): 1,
        ("a", a.created_at, 2, "rewrap_to"): 1,
        ("a", a.created_at, 2, "rewrap_from"): 1,
        ("b", b.created_at, 1, "rewrap_to"): 1,
        ("s", s.created_at, 1, "verify"): 1,
        ("b", b.created_at, 1, "verify"): 1,
    }


def test_the_label_cap_is_shared_through_its_file(tmp_path: Path) -> None:
    first, second = KeyLabels(2, tmp_path), KeyLabels(2, tmp_path)
    assert first.labelled("x")
    assert second.labelled("y")
    assert not first.labelled("z")  # two chosen on the host already
    assert first.labelled("y")  # chosen by the other process
    assert second.labelled("x")
    assert not second.labelled("z")
    assert (tmp_path / "key_labels.txt").read_text().split() == ["x", "y"]
    alone = KeyLabels(1)
    assert alone.labelled("p")
    assert not alone.labelled("q")
    assert alone.labelled("p")
    assert not KeyLabels(0).labelled("p")


def test_an_unreadable_store_says_why(tmp_path: Path) -> None:
    store = SqliteUsageStore(tmp_path / "missing" / "dir" / "usage.sqlite")
    (tmp_path / "missing").write_text("")
    with pytest.raises(UsageUnavailable, match="usage file"):
        store.read_all()


def test_a_postgresql_store_without_the_table_says_how_to_add_it(pg_database: str) -> None:
    store = PostgresUsageStore(pg_database)
    try:
        with pytest.raises(UsageUnavailable, match="cryptd keystore schema"):
            store.add({("k", "2026-01-01T00:00:00Z", 1, "encrypt"): (1, 1.0)})
        keys = PostgresKeyStore(pg_database)
        keys.create_schema()
        keys.close()
        store.add({("k", "2026-01-01T00:00:00Z", 1, "encrypt"): (2, 1.0)})
        store.add({("k", "2026-01-01T00:00:00Z", 1, "encrypt"): (3, 7.5)})
        (row,) = store.read("k", "2026-01-01T00:00:00Z")
        assert (row.count, row.last_used_at) == (5, 7.5)
        assert store.read("k", "2025-01-01T00:00:00Z") == []
    finally:
        store.close()


def test_a_read_during_a_flush_sees_every_count_once(tmp_path: Path, keyring: Keyring) -> None:
    path = tmp_path / "usage.sqlite"
    recorder = UsageRecorder(SqliteUsageStore(path))
    key = keyring["a"]
    one = [{"key_version": 1}]

    async def scenario() -> None:
        recorder.record(keyring, key, "encrypt", [None], one)
        await recorder.flush()  # creates the file: 1 stored
        # Another process holds the database's write lock: the next flush waits for it.
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        for _ in range(3):
            recorder.record(keyring, key, "encrypt", [None], one)
        flushing = asyncio.create_task(recorder.flush())
        await asyncio.sleep(0.2)  # the 3 are cut and being written
        recorder.record(keyring, key, "encrypt", [None], one)  # counting goes on meanwhile
        reading = asyncio.create_task(recorder.usage(key))
        await asyncio.sleep(0.2)
        blocker.execute("COMMIT")
        blocker.close()
        await flushing
        usage = await reading
        assert usage is not None
        assert usage[1]["operations"]["encrypt"] == 5
        await recorder.close()

    asyncio.run(scenario())
    (row,) = stored(path)
    assert row.count == 5


def _add_once(path: Path, start: Any, outcomes: Any) -> None:
    store = SqliteUsageStore(path)
    start.wait()
    try:
        store.add({("k", "2026-01-01T00:00:00Z", 1, "encrypt"): (1, 1.0)})
        outcomes.put("stored")
    except UsageUnavailable as exc:
        outcomes.put(str(exc))
    finally:
        store.close()


@pytest.mark.slow
def test_workers_opening_a_new_file_at_once_all_store_their_counts(tmp_path: Path) -> None:
    # The workers of a host flush for the first time together (at shutdown, with a long
    # interval): switching the new file to WAL mode must not fail for the slower ones.
    context = multiprocessing.get_context("fork")
    workers, trials = 4, 50
    for trial in range(trials):
        path = tmp_path / f"usage-{trial}.sqlite"
        start, outcomes = context.Barrier(workers), context.Queue()
        processes = [
            context.Process(target=_add_once, args=(path, start, outcomes)) for _ in range(workers)
        ]
        for process in processes:
            process.start()
        results = [outcomes.get(timeout=30) for _ in processes]
        for process in processes:
            process.join()
        assert results == ["stored"] * workers, f"trial {trial}: {results}"
        (row,) = stored(path)
        assert row.count == workers
