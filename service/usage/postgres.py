"""Usage counters in the PostgreSQL key store's database, shared by every replica.

One table, ``cryptd_key_usage`` (created with the key store's schema by ``cryptd keystore
init``; ``cryptd keystore schema`` prints it for a store made before it existed). A flush is
one statement: the increments as arrays, ``unnest``-ed into one ``INSERT ... ON CONFLICT DO
UPDATE SET count = count + EXCLUDED.count``, rows in primary-key order so that two replicas
flushing the same keys lock them in the same order. Its own connection: a flush never waits
for the key store's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from service.pgconn import SharedConnection, reason
from service.usage.store import Increment, UsageKey, UsageRow, UsageUnavailable, ordered

TABLE = "cryptd_key_usage"
UPSERT = (
    "INSERT INTO cryptd_key_usage (name, key_created, version, operation, count, last_used_at) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[], %s::text[], %s::bigint[], "
    "%s::timestamptz[]) "
    "ON CONFLICT (name, key_created, version, operation) DO UPDATE SET "
    "count = cryptd_key_usage.count + EXCLUDED.count, "
    "last_used_at = GREATEST(cryptd_key_usage.last_used_at, EXCLUDED.last_used_at)"
)
SELECT = (
    "SELECT name, key_created, version, operation, count, "
    "extract(epoch FROM last_used_at)::float8 FROM cryptd_key_usage"
)


class PostgresUsageStore:
    backend = "postgresql"

    def __init__(self, url: str) -> None:
        self._pg = SharedConnection(url)
        self._description = self._pg.description

    @property
    def description(self) -> str:
        return self._description

    @contextlib.contextmanager
    def _session(self) -> Iterator[psycopg.Connection[Any]]:
        with self._pg.turn() as connection:
            try:
                yield connection()
            except pg_errors.UndefinedTable:
                raise UsageUnavailable(
                    f"{self._description} has no {TABLE} table: create it with "
                    "`cryptd keystore schema` (a role that may create tables)"
                ) from None
            except psycopg.Error as exc:
                self._pg.drop()
                raise UsageUnavailable(f"{self._description}: {reason(exc)}") from None

    def add(self, increments: Mapping[UsageKey, Increment]) -> None:
        if not increments:
            return
        columns: list[list[Any]] = [[], [], [], [], [], []]
        for (name, created, version, operation), (count, at) in ordered(increments):
            for column, value in zip(
                columns,
                (name, created, version, operation, count, datetime.fromtimestamp(at, UTC)),
                strict=True,
            ):
                column.append(value)
        with self._session() as conn:
            conn.execute(UPSERT, columns)

    def read(self, key: str, key_created: str) -> list[UsageRow]:
        with self._session() as conn:
            rows = conn.execute(
                SELECT + " WHERE name = %s AND key_created = %s", (key, key_created)
            ).fetchall()
        return [UsageRow(*row) for row in rows]

    def read_all(self) -> list[UsageRow]:
        with self._session() as conn:
            rows = conn.execute(SELECT + " ORDER BY name, version, operation").fetchall()
        return [UsageRow(*row) for row in rows]

    def close(self) -> None:
        self._pg.close()
