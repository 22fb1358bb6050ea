"""A SQL table as a migration source (SQLAlchemy: SQLite, PostgreSQL, any dialect).

Rows are read by keyset pagination on the id column (``WHERE id > :last ORDER BY id LIMIT n``),
never with OFFSET and never the whole table, so memory stays flat and the last id of a
committed page is the resume position. Each page's new tokens are written in one transaction
with a compare-and-set (``WHERE id = :id AND column = :old``): a row that the application
changed after it was read is left as it is and reported, never overwritten with a stale value.

An id column that is not declared unique is checked page by page: rows sharing an id are
reported (``duplicate_id``) and left alone, since no UPDATE could address one of them. Rows with
a NULL id cannot be addressed either; they are counted and reported once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .ids import decode_id, encode_id
from .model import (
    FAIL_DUPLICATE_ID,
    FAIL_NOT_TEXT,
    FAIL_NULL_ID,
    MigrationRefused,
    Page,
    RunStopped,
)
from .source import Changes, Written
from .sql_write import writer_for

_SQLITE_ROWID = frozenset({"rowid", "_rowid_", "oid"})


def engine_url(url: str) -> sa.URL:
    """The SQLAlchemy URL, with plain ``postgresql://`` meaning the psycopg 3 driver (the
    project's PostgreSQL driver) rather than SQLAlchemy's historical psycopg2 default."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise MigrationRefused(f"--url is not a SQLAlchemy database URL: {url!r}") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _as_text(value: Any) -> tuple[str | None, tuple[str, str] | None]:
    """A stored ciphertext value as token text, or why it is not one."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, None
    if isinstance(value, bytes | memoryview):
        try:
            return bytes(value).decode("ascii"), None
        except UnicodeDecodeError:
            return None, (FAIL_NOT_TEXT, "the value is binary, not an ASCII token")
    return None, (FAIL_NOT_TEXT, f"the value is a {type(value).__name__}, not a token")


def _as_aad(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes | memoryview):
        return bytes(value)
    return str(value).encode("utf-8")


class SqlSource:
    repeatable = True

    def __init__(
        self,
        url: str,
        table: str,
        column: str,
        id_column: str,
        aad_column: str | None = None,
        *,
        writer: str | None = None,
    ) -> None:
        self._url = engine_url(url)
        schema, _, name = table.rpartition(".")
        self._schema = schema or None
        self._table_name = name
        self._column = column
        self._id = id_column
        self._aad = aad_column
        try:
            self._engine: Engine = sa.create_engine(self._url)
            self._conn: Connection = self._engine.connect()
        except (sa.exc.SQLAlchemyError, ImportError) as exc:
            raise MigrationRefused(f"cannot open {self._public_url()}: {_brief(exc)}") from None
        self._unique = self._reflect()
        columns: list[sa.ColumnClause[Any]] = [sa.column(id_column), sa.column(column)]
        if aad_column is not None:
            columns.append(sa.column(aad_column))
        self._t = sa.table(name, *columns, schema=self._schema)
        self._writer = writer_for(self._conn, self._t, id_column, column, writer)
        self._after: Any = None
        self._queries: dict[tuple[bool, int], sa.Select[Any]] = {}
        self._nulls_left = 0
        self._nulls_done = 0
        self._exhausted = False

    def _public_url(self) -> str:
        return self._url.render_as_string(hide_password=True)

    def identity(self) -> dict[str, Any]:
        return {
            "kind": "sql",
            "url": self._public_url(),
            "table": ".".join(filter(None, (self._schema, self._table_name))),
            "column": self._column,
            "id_column": self._id,
            "aad_column": self._aad,
        }

    # -- checks before anything is read ----------------------------------------------------

    def _reflect(self) -> bool:
        """Check the table and its columns; return whether the id column is declared unique."""
        inspector = sa.inspect(self._conn)
        where = f"{self._public_url()}"
        try:
            if not inspector.has_table(self._table_name, schema=self._schema):
                raise MigrationRefused(f"there is no table {self._table_name!r} in {where}")
            names = [c["name"] for c in inspector.get_columns(self._table_name, self._schema)]
        except sa.exc.SQLAlchemyError as exc:
            raise MigrationRefused(f"cannot read the table definition: {_brief(exc)}") from None
        rowid = self._conn.dialect.name == "sqlite" and self._id.lower() in _SQLITE_ROWID
        for role, name in (("id", self._id), ("ciphertext", self._column), ("aad", self._aad)):
            if name is None or name in names or (role == "id" and rowid):
                continue
            hint = " (SQLite tables also have --id-column rowid)" if role == "id" else ""
            raise MigrationRefused(
                f"table {self._table_name!r} has no {role} column {name!r}; "
                f"its columns are: {', '.join(names)}{hint}"
            )
        if self._id == self._column:
            raise MigrationRefused("--id-column and --column must be different columns")
        if rowid:
            return True
        pk = inspector.get_pk_constraint(self._table_name, self._schema)
        if pk.get("constrained_columns") == [self._id]:
            return True
        uniques = inspector.get_unique_constraints(self._table_name, self._schema)
        indexes = inspector.get_indexes(self._table_name, self._schema)
        return any(u["column_names"] == [self._id] for u in uniques) or any(
            i.get("unique") and i["column_names"] == [self._id] for i in indexes
        )

    # -- reading ------------------------------------------------------------------------------

    def start(self, position: Any | None) -> int | None:
        t = self._t
        ident = t.c[self._id]
        if position is None:
            self._after, self._nulls_done = None, 0
        else:
            self._after, self._nulls_done = decode_id(position["after"]), int(position["nulls"])
        nulls = sa.select(sa.func.count()).select_from(t).where(ident.is_(None))
        remaining = sa.select(sa.func.count()).select_from(t).where(self._after_clause())
        try:
            self._nulls_left = max(
                0, int(self._conn.execute(nulls).scalar_one()) - self._nulls_done
            )
            count = int(self._conn.execute(remaining, self._params()).scalar_one())
            # Ordering is checked here, where a column that has none fails with a clear error.
            first = self._conn.execute(self._page_query(1), self._params()).first()
            self._conn.commit()
        except sa.exc.SQLAlchemyError as exc:
            self._conn.rollback()
            raise MigrationRefused(
                f"cannot read {self._table_name!r} in id order (is {self._id!r} orderable?): "
                f"{_brief(exc)}"
            ) from None
        if first is not None:
            encode_id(first[0])  # refuses an id type a checkpoint cannot hold, before any write
        return count + self._nulls_left

    def _after_clause(self) -> sa.ColumnElement[bool]:
        ident = self._t.c[self._id]
        return ident.is_not(None) if self._after is None else ident > sa.bindparam("after")

    def _page_query(self, limit: int) -> sa.Select[Any]:
        """Built once per shape (first page, later pages) and limit: SQLAlchemy then reuses
        its compiled form, and a page costs the driver's work only."""
        key = (self._after is None, limit)
        query = self._queries.get(key)
        if query is None:
            t = self._t
            columns = [t.c[self._id], t.c[self._column]]
            if self._aad is not None:
                columns.append(t.c[self._aad])
            where = self._after_clause()
            query = sa.select(*columns).where(where).order_by(t.c[self._id]).limit(limit)
            self._queries[key] = query
        return query

    def _params(self) -> dict[str, Any]:
        return {} if self._after is None else {"after": self._after}

    def position(self) -> dict[str, Any]:
        return self._position()

    def _position(self) -> dict[str, Any]:
        return {"after": encode_id(self._after), "nulls": self._nulls_done}

    def read(self, limit: int) -> Page | None:
        if self._nulls_left:
            return self._null_page(limit)
        if self._exhausted:
            return None
        try:
            rows = list(self._conn.execute(self._page_query(limit), self._params()).all())
            if not self._unique and len(rows) == limit:
                rows = self._complete_group(rows)
            self._conn.commit()
        except sa.exc.SQLAlchemyError as exc:
            self._conn.rollback()
            raise RunStopped(f"reading {self._table_name!r} failed: {_brief(exc)}") from None
        if not rows:
            self._exhausted = True
            return None
        ids = [r[0] for r in rows]
        values = [r[1] for r in rows]
        failures: dict[int, tuple[str, str]] = {}
        if all(type(v) is str for v in values):
            tokens: list[str | None] = values
        else:
            tokens = []
            for index, value in enumerate(values):
                token, failure = _as_text(value)
                tokens.append(token)
                if failure is not None:
                    failures[index] = failure
        aads = [_as_aad(r[2]) for r in rows] if self._aad is not None else None
        if not self._unique:
            _mark_duplicates(ids, failures)
        self._after = ids[-1]
        return Page(ids, tokens, aads, self._position(), failures, values)

    def _complete_group(self, rows: list[Any]) -> list[Any]:
        """With an id that is not declared unique, a page must not end inside a group of rows
        sharing an id: replace the page's last group by all rows holding that id."""
        last = rows[-1][0]
        t = self._t
        columns = [t.c[self._id], t.c[self._column]]
        if self._aad is not None:
            columns.append(t.c[self._aad])
        group = self._conn.execute(sa.select(*columns).where(t.c[self._id] == last)).all()
        head = [r for r in rows if r[0] != last]
        return head + list(group)

    def _null_page(self, limit: int) -> Page:
        n = min(limit, self._nulls_left)
        self._nulls_left -= n
        self._nulls_done += n
        failure = (FAIL_NULL_ID, f"the id column {self._id!r} is NULL: the row cannot be addressed")
        return Page(
            [None] * n, [None] * n, None, self._position(), dict.fromkeys(range(n), failure)
        )

    # -- writing ------------------------------------------------------------------------------

    def write(self, group: Sequence[tuple[Page, Changes]], written: Written) -> None:
        # The group's rows as parallel lists (no object per row); ``places`` maps them back to
        # (page number, row index) for the rows that turn out to have changed.
        ids: list[Any] = []
        olds: list[Any] = []
        news: list[Any] = []
        places: list[tuple[int, list[int]]] = []
        for number, (page, changes) in enumerate(group):
            if not changes:
                continue
            originals: list[Any] = page.extra
            page_ids = page.ids
            indexes = [index for index, _ in changes]
            tokens = [token for _, token in changes]
            values = [originals[index] for index in indexes]
            ids += [page_ids[index] for index in indexes]
            olds += values
            if all(type(value) is str for value in values):
                news += tokens
            else:  # a binary column (or a SQLite one holding both): new values as bytes too
                news += [
                    t if type(v) is str else t.encode("ascii")
                    for t, v in zip(tokens, values, strict=True)
                ]
            places.append((number, indexes))
        if not ids:
            written([], None)
            return
        conn = self._conn
        # The writers use the driver's cursor, so its errors (a value too long for the column)
        # arrive unwrapped by SQLAlchemy: they stop the run as SQLAlchemy's do.
        driver_error = getattr(conn.dialect.dbapi, "Error", None)
        failures: tuple[type[BaseException], ...] = (sa.exc.SQLAlchemyError,)
        if isinstance(driver_error, type) and issubclass(driver_error, BaseException):
            failures = (sa.exc.SQLAlchemyError, driver_error)
        try:
            # The writers use the driver's cursor, which SQLAlchemy does not see: begin here so
            # that commit() below commits (it is a no-op without a transaction it began).
            if not conn.in_transaction():
                conn.begin()
            updated = set(self._writer.update(conn, ids, olds, news))
            conflicts = [] if len(updated) == len(ids) else _conflicts(places, updated)
            first = min(updated, default=None)
            witness = (
                None
                if first is None
                else {"id": encode_id(ids[first]), "token": _token_text(news[first])}
            )
            written(conflicts, witness)
            conn.commit()
        except failures as exc:
            _rollback(conn)
            raise RunStopped(f"writing to {self._table_name!r} failed: {_brief(exc)}") from None
        except BaseException:
            _rollback(conn)
            raise

    def landed(self, witness: Any) -> bool:
        if witness is None:
            return True
        t = self._t
        query = sa.select(t.c[self._column]).where(t.c[self._id] == decode_id(witness["id"]))
        try:
            value = self._conn.execute(query).scalar_one_or_none()
            self._conn.commit()
        except sa.exc.SQLAlchemyError as exc:
            self._conn.rollback()
            raise MigrationRefused(f"cannot read {self._table_name!r}: {_brief(exc)}") from None
        token, _ = _as_text(value)
        return bool(token == witness["token"])

    def close(self) -> None:
        _rollback(self._conn)
        self._conn.close()
        self._engine.dispose()


def _conflicts(places: list[tuple[int, list[int]]], updated: set[int]) -> list[tuple[int, int]]:
    """(page number, row index) of the rows not in ``updated`` (positions in the flat lists)."""
    conflicts: list[tuple[int, int]] = []
    k = 0
    for number, indexes in places:
        for index in indexes:
            if k not in updated:
                conflicts.append((number, index))
            k += 1
    return conflicts


def _token_text(new: str | bytes) -> str:
    return new.decode("ascii") if isinstance(new, bytes) else new


def _mark_duplicates(ids: list[Any], failures: dict[int, tuple[str, str]]) -> None:
    """Ids are in order, so rows sharing an id are neighbours."""
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        if j - i > 1:
            message = f"{j - i} rows share this id: none of them can be addressed alone"
            for index in range(i, j):
                failures[index] = (FAIL_DUPLICATE_ID, message)
        i = j


def _rollback(conn: Connection) -> None:
    with contextlib.suppress(sa.exc.SQLAlchemyError):
        conn.rollback()


def _brief(exc: BaseException) -> str:
    """A database error's first line, without SQLAlchemy's statement and parameter dump (the
    parameters are tokens)."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
