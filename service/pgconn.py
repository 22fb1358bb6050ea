"""PostgreSQL connections for the stores that live in the database (keys, usage counters).

The URL's libpq parameters plus :data:`DEFAULTS`, a description safe for logs (no password),
an error's first line (no query text, no parameters), and :class:`SharedConnection`: the one
connection a store's threads take turns on, opened on first use and again after it broke.
Each store maps the driver's errors to its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

# What a connection gets unless the URL says otherwise: fail fast when the database is down,
# notice a dead peer, and name the application in pg_stat_activity.
DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "cryptd",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}


def connection_info(url: str) -> str:
    """The libpq connection string: the URL's parameters, plus :data:`DEFAULTS` where unset."""
    try:
        params: dict[str, Any] = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        raise ValueError("CRYPTD_KEYSTORE_URL is not a valid PostgreSQL URL") from None
    for name, value in DEFAULTS.items():
        params.setdefault(name, value)
    return make_conninfo(**params)


def describe(conninfo: str) -> str:
    params = conninfo_to_dict(conninfo)
    user = str(params.get("user") or "")
    host = params.get("host", "localhost")
    port = params.get("port", "5432")
    return f"postgresql {user + '@' if user else ''}{host}:{port}/{params.get('dbname', '')}"


def reason(exc: psycopg.Error) -> str:
    """The first line of the server's or libpq's message: no query text, no parameters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first[:200]


class SharedConnection:
    """One autocommit connection for a store's threads, one statement sequence at a time."""

    def __init__(
        self, url: str, configure: Callable[[psycopg.Connection[Any]], None] | None = None
    ) -> None:
        self.conninfo = connection_info(url)
        self.description = describe(self.conninfo)
        self._configure = configure
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    def connect(self) -> psycopg.Connection[Any]:
        """A new connection of the caller's own (configured like the shared one)."""
        conn = psycopg.connect(self.conninfo, autocommit=True)
        if self._configure is not None:
            self._configure(conn)
        return conn

    @contextlib.contextmanager
    def turn(self) -> Iterator[Callable[[], psycopg.Connection[Any]]]:
        """Hold the connection for one statement sequence: yields the function that gives
        it, (re)opened as needed (errors while opening reach the caller's handlers)."""
        with self._lock:
            yield self._open

    def _open(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self.connect()
        return self._conn

    def drop(self) -> None:
        """Close the connection after an error (the caller holds its turn)."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self.drop()
