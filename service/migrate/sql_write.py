"""Writing a group of new tokens, compare-and-set, inside the caller's transaction.

A writer takes the rows as three parallel lists (ids, values as read, new values: no object per
row, since thousands of rows pass per commit) and answers which rows it updated (``WHERE id =
:id AND column = :old`` matched), so a row changed by someone else since it was read is never
overwritten. Writers per dialect, since the fastest way to send a thousand updates differs
(measured in loadtest/migrate_bench.py):

- ``sqlite``: the driver's executemany of one prepared UPDATE (no network; its summed row
  count tells whether every row was updated, and only when not are the rows looked at);
- ``postgresql``: one statement for the whole page, ``UPDATE ... FROM unnest(ids, olds,
  news) ... RETURNING``, three array parameters (one round trip, a constant statement whose
  plan is an index nested loop whatever the group's size). The arrays go in binary format:
  psycopg's text format quotes every element in Python (about 13 µs a row of the tool's CPU,
  against 1.4 µs in binary);
- ``pg-copy``: COPY into a session-local temporary table, then one ``UPDATE ... FROM`` it: about
  half the client CPU, but more server CPU once a group holds thousands of rows (the planner
  has no statistics for the temporary table), so no cheaper in total;
- ``pg-executemany``: psycopg's pipelined executemany with RETURNING (about twice the CPU);
- ``generic``: SQLAlchemy Core, one UPDATE per row (any dialect; correct, not fast).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .model import MigrationRefused


class Writer(Protocol):
    def update(
        self, conn: Connection, ids: list[Any], olds: list[Any], news: list[Any]
    ) -> Collection[int]:
        """Set row ``ids[k]`` to ``news[k]`` where it still holds ``olds[k]`` (the value as
        read, str or bytes; ``news[k]`` is of the same type), no commit; return the ``k`` of the
        rows updated."""
        ...


def _quoted(conn: Connection, table: sa.TableClause, *columns: str) -> tuple[str, ...]:
    preparer = conn.dialect.identifier_preparer
    return (preparer.format_table(table), *(preparer.quote(c) for c in columns))


class SqliteWriter:
    def __init__(self, conn: Connection, table: sa.TableClause, id_column: str, column: str):
        t, ident, col = _quoted(conn, table, id_column, column)
        self._sql = f"UPDATE {t} SET {col} = ? WHERE {ident} = ? AND {col} = ?"  # noqa: S608
        self._check = f"SELECT {col} FROM {t} WHERE {ident} = ?"  # noqa: S608

    def update(
        self, conn: Connection, ids: list[Any], olds: list[Any], news: list[Any]
    ) -> Collection[int]:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.executemany(self._sql, zip(news, ids, olds, strict=True))
            if cursor.rowcount == len(ids):  # the sum over the statements
                return range(len(ids))
            # Some rows changed since they were read: the rows holding their new (random,
            # never repeated) token are the ones this transaction updated.
            updated: list[int] = []
            for k, ident in enumerate(ids):
                found = cursor.execute(self._check, (ident,)).fetchone()
                if found is not None and found[0] == news[k]:
                    updated.append(k)
            return updated
        finally:
            cursor.close()


class _PostgresBase:
    def __init__(self, conn: Connection, table: sa.TableClause, id_column: str, column: str):
        self.t, self.ident, self.col = _quoted(conn, table, id_column, column)
        # The types without their modifier (varchar, not varchar(512)): an explicit cast to
        # varchar(n) cuts a longer value silently, whereas the assignment to the column
        # refuses it, so a token too long for the column stops the run instead of being
        # stored cut (an X-Wing token is 1,570 characters where RSA-2048's was 437).
        types: dict[str, str] = dict(
            conn.exec_driver_sql(
                "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute"
                " WHERE attrelid = CAST(%(t)s AS regclass) AND attnum > 0"
                " AND NOT attisdropped AND attname = ANY(%(names)s)",
                {"t": self.t, "names": [id_column, column]},
            ).all()
        )
        conn.commit()
        if id_column not in types or column not in types:
            raise MigrationRefused(f"cannot read the column types of {self.t}")
        self.id_type, self.col_type = types[id_column], types[column]

    @staticmethod
    def _cursor(conn: Connection) -> Any:
        return conn.connection.driver_connection.cursor()  # type: ignore[union-attr]


class PostgresUnnestWriter(_PostgresBase):
    def __init__(self, conn: Connection, table: sa.TableClause, id_column: str, column: str):
        super().__init__(conn, table, id_column, column)
        t, ident, col = self.t, self.ident, self.col
        self._sql = (
            f"UPDATE {t} SET {col} = v.new"  # noqa: S608
            f" FROM unnest(%b::{self.id_type}[], %b::{self.col_type}[], %b::{self.col_type}[])"
            f" WITH ORDINALITY AS v(id, old, new, n)"
            f" WHERE {t}.{ident} = v.id AND {t}.{col} = v.old RETURNING v.n"
        )

    def update(
        self, conn: Connection, ids: list[Any], olds: list[Any], news: list[Any]
    ) -> Collection[int]:
        with self._cursor(conn) as cursor:
            cursor.execute(self._sql, (ids, olds, news))
            return [int(row[0]) - 1 for row in cursor.fetchall()]  # ordinals count from 1


class PostgresCopyWriter(_PostgresBase):
    """COPY the page into a session-local temporary table, then one UPDATE joined to it."""

    _TEMP = "cryptd_migrate_page"

    def __init__(self, conn: Connection, table: sa.TableClause, id_column: str, column: str):
        super().__init__(conn, table, id_column, column)
        t, ident, col, temp = self.t, self.ident, self.col, self._TEMP
        conn.exec_driver_sql(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS {temp} (n integer, id {self.id_type},"
            f" old {self.col_type}, new {self.col_type}) ON COMMIT DELETE ROWS"
        )
        conn.commit()
        self._copy = f"COPY {temp} (n, id, old, new) FROM STDIN"
        self._sql = (
            f"UPDATE {t} SET {col} = p.new FROM {temp} AS p"  # noqa: S608
            f" WHERE {t}.{ident} = p.id AND {t}.{col} = p.old RETURNING p.n"
        )

    def update(
        self, conn: Connection, ids: list[Any], olds: list[Any], news: list[Any]
    ) -> Collection[int]:
        with self._cursor(conn) as cursor:
            with cursor.copy(self._copy) as copy:
                for row in zip(range(len(ids)), ids, olds, news, strict=True):
                    copy.write_row(row)
            cursor.execute(self._sql)
            return [int(row[0]) for row in cursor.fetchall()]


class PostgresExecutemanyWriter(_PostgresBase):
    def __init__(self, conn: Connection, table: sa.TableClause, id_column: str, column: str):
        super().__init__(conn, table, id_column, column)
        t, ident, col = self.t, self.ident, self.col
        self._sql = f"UPDATE {t} SET {col} = %s WHERE {ident} = %s AND {col} = %s RETURNING 1"  # noqa: S608

    def update(
        self, conn: Connection, ids: list[Any], olds: list[Any], news: list[Any]
    ) -> Collection[int]:
        updated: list[int] = []
        with self._cursor(conn) as cursor:
            cursor.executemany(self._sql, list(zip(news, ids, olds, strict=True)), returning=True)
            for k in range(len(ids)):
                if cursor.fetchone() is not None:
                    updated.append(k)
                cursor.nextset()
        return updated


class GenericWriter:
    def __init__(self, conn: Connection, table: sa.TableClause, id_column: str, column: str):
        del conn
        self._statement = (
            sa.update(table)
            .where(table.c[id_column] == sa.bindparam("_id"))
            .where(table.c[column] == sa.bindparam("_old"))
            .values({column: sa.bindparam("_new")})
        )

    def update(
        self, conn: Connection, ids: list[Any], olds: list[Any], news: list[Any]
    ) -> Collection[int]:
        updated: list[int] = []
        for k, (ident, old, new) in enumerate(zip(ids, olds, news, strict=True)):
            params = {"_id": ident, "_old": old, "_new": new}
            if conn.execute(self._statement, params).rowcount == 1:
                updated.append(k)
        return updated


WRITERS: dict[str, Callable[[Connection, sa.TableClause, str, str], Writer]] = {
    "sqlite": SqliteWriter,
    "postgresql": PostgresUnnestWriter,
    "pg-copy": PostgresCopyWriter,
    "pg-executemany": PostgresExecutemanyWriter,
    "generic": GenericWriter,
}


def writer_for(
    conn: Connection, table: sa.TableClause, id_column: str, column: str, name: str | None
) -> Writer:
    dialect, driver = conn.dialect.name, conn.dialect.driver
    if name is None:
        if dialect == "sqlite" and driver == "pysqlite":
            name = "sqlite"
        elif dialect == "postgresql" and driver == "psycopg":
            name = "postgresql"
        else:
            name = "generic"
    needs = {"sqlite": ("sqlite", "pysqlite"), "postgresql": ("postgresql", "psycopg")}
    needs["pg-executemany"] = needs["pg-copy"] = needs["postgresql"]
    if name not in WRITERS:
        raise MigrationRefused(f"unknown writer {name!r}; known: {', '.join(WRITERS)}")
    if name in needs and needs[name] != (dialect, driver):
        raise MigrationRefused(f"the {name} writer needs {'+'.join(needs[name])}")
    return WRITERS[name](conn, table, id_column, column)
