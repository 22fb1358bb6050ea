"""Usage counters in a SQLite database beside the keyring file (the file key store's host).

Why SQLite beside the keyring rather than the host's LMDB replay store: the replay directory
is scratch space (a private temporary directory by default, ideally tmpfs, emptied on a new
boot), while counts must outlive restarts like the keyring does; SQLite gives every worker of
the host transactions with increments (``INSERT ... ON CONFLICT DO UPDATE SET count = count +
...``, the same statement as PostgreSQL's), a journal that survives a crash, and a file an
operator can query with ``sqlite3``. Writers take the database lock once per flush for a few
rows (WAL mode: readers never wait for them).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from service.usage.store import Increment, UsageKey, UsageRow, UsageUnavailable, ordered

SCHEMA = """CREATE TABLE IF NOT EXISTS key_usage (
    key TEXT NOT NULL,
    key_created TEXT NOT NULL,
    version INTEGER NOT NULL,
    operation TEXT NOT NULL,
    count INTEGER NOT NULL,
    last_used_at REAL NOT NULL,
    PRIMARY KEY (key, key_created, version, operation)
) WITHOUT ROWID"""
UPSERT = (
    "INSERT INTO key_usage (key, key_created, version, operation, count, last_used_at) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key, key_created, version, operation) DO UPDATE "
    "SET count = count + excluded.count, "
    "last_used_at = max(last_used_at, excluded.last_used_at)"
)
SELECT = "SELECT key, key_created, version, operation, count, last_used_at FROM key_usage"
BUSY_TIMEOUT = 10.0  # seconds a writer waits for another worker's flush
BUSY_RETRY = 0.005  # seconds between tries of a step SQLite does not wait for itself


class SqliteUsageStore:
    backend = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    @property
    def description(self) -> str:
        return f"file {self.path}"

    @contextlib.contextmanager
    def _session(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = self._connect()
                yield self._conn
            except (sqlite3.Error, OSError) as exc:
                self._drop()
                reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                raise UsageUnavailable(f"usage file {self.path}: {reason}") from None

    def _connect(self) -> sqlite3.Connection:
        if not self.path.exists():
            # Private like the keyring; SQLite gives its -wal and -shm files the same mode.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        conn = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
        )
        try:
            _switch_to_wal(conn)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def add(self, increments: Mapping[UsageKey, Increment]) -> None:
        if not increments:
            return
        rows = [(*key, count, at) for key, (count, at) in ordered(increments)]
        with self._session() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(UPSERT, rows)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def read(self, key: str, key_created: str) -> list[UsageRow]:
        with self._session() as conn:
            found = conn.execute(
                SELECT + " WHERE key = ? AND key_created = ?",
                (key, key_created),
            ).fetchall()
        return [UsageRow(*row) for row in found]

    def read_all(self) -> list[UsageRow]:
        with self._session() as conn:
            found = conn.execute(SELECT + " ORDER BY key, version, operation").fetchall()
        return [UsageRow(*row) for row in found]

    def close(self) -> None:
        with self._lock:
            self._drop()


def _switch_to_wal(conn: sqlite3.Connection) -> None:
    """Switching a new file to WAL mode answers SQLITE_BUSY at once, without the busy
    timeout, when another connection is switching it too: the workers of a host open the file
    at the same moment (here 9 of 160 connections in 40 trials of four at once). Tried again
    until ``BUSY_TIMEOUT``, as the other statements wait."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
        time.sleep(BUSY_RETRY)
