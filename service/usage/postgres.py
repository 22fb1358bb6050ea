"""Usage counters in the PostgreSQL key store's database, shared by every replica.

One table, ``cryptd_key_usage`` (created with the key store's schema by ``cryptd keystore
init``; ``cryptd keystore schema`` prints it for a store made before it existed). A flush is
one statement: the increments as arrays, ``unnest``-ed into one ``INSERT ... ON CONFLICT DO
UPDATE SET count = count + EXCLUDED.count``, rows in primary-key order so that two replicas
flushing the same keys lock them in the same order. Its own connection: a flush never waits
for the key store's.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from service.pgconn import PostgresStore, Refusal, reason
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


class PostgresUsageStore(PostgresStore):
    backend = "postgresql"

    def _connect(self) -> psycopg.Connection[Any]:
        conn = super()._connect()
        # Counts are informational: a flush must not wait for a synchronous standby. With
        # the standby lost it would wait until one came back, holding the flusher and then
        # the worker's shutdown (killed after its grace period, the last counts lost); the
        # price is that a failover may lose the last seconds of counts.
        conn.execute("SET synchronous_commit = local")
        return conn

    def _refusal(self, exc: psycopg.Error) -> Refusal:
        if isinstance(exc, pg_errors.UndefinedTable):
            return UsageUnavailable(
                f"{self._description} has no {TABLE} table: create it with "
                "`cryptd keystore schema` (a role that may create tables)"
            ), False
        return UsageUnavailable(f"{self._description}: {reason(exc)}"), True

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
