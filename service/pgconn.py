"""PostgreSQL connections for the stores that live in the database (keys, usage counters).

The URL's libpq parameters plus :data:`DEFAULTS`, a description safe for logs (no password),
an error's first line (no query text, no parameters), and :class:`PostgresStore`: the
connection a store's threads take turns on (and any other a store keeps for work that must
not queue behind it, :class:`Line`), opened on first use and again after it broke, the
driver's errors mapped to the store's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

# What a connection gets unless the URL says otherwise: fail fast when the database is down,
# notice a dead peer, and name the application in pg_stat_activity. A path that dies without
# a reset (a link down, a host cut off, packets dropped) would otherwise hold a statement, its
# request and the store's lock for TCP's retransmission limit (~15 min): tcp_user_timeout
# ends a statement whose bytes go unacknowledged for 5 s, and the keepalives a connection
# waiting for an answer that will not come (5 s idle, then two probes 2 s apart). A slow
# statement on a live server is not cut short: its server still acknowledges.
DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "cryptd",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "2",
    "tcp_user_timeout": "5000",
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


# What a store makes of a driver error: its own exception, and whether the connection is
# dropped (it may be broken) rather than kept (the statement failed, the connection is fine).
Refusal = tuple[Exception, bool]


class Line:
    """One connection and the lock its users take turns on: one statement sequence at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None

    def drop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None


class PostgresStore:
    """Base of a store in the database: one autocommit connection its threads take turns on
    (a subclass may keep more, :meth:`_line`), opened on first use and again after it broke,
    and the store's reading of driver errors (:meth:`_refusal`)."""

    def __init__(self, url: str) -> None:
        self._conninfo = connection_info(url)
        self._description = describe(self._conninfo)
        self._lines = [Line()]

    @property
    def description(self) -> str:
        return self._description

    def _line(self) -> Line:
        """Another connection of the store's own, for work that must never wait for what the
        shared one is doing."""
        line = Line()
        self._lines.append(line)
        return line

    def _connect(self) -> psycopg.Connection[Any]:
        """A new connection (the shared one, or one of the caller's own)."""
        return psycopg.connect(self._conninfo, autocommit=True)

    def _refusal(self, exc: psycopg.Error) -> Refusal:
        return exc, True

    @contextlib.contextmanager
    def _session(self, line: Line | None = None) -> Iterator[psycopg.Connection[Any]]:
        """The shared connection (or ``line``'s), (re)opened as needed; a driver error raised
        meanwhile becomes the store's own (:meth:`_refusal`)."""
        line = line or self._lines[0]
        with line.lock:
            try:
                if line.conn is None or line.conn.closed or line.conn.broken:
                    line.conn = self._connect()
                yield line.conn
            except psycopg.Error as exc:
                error, drop = self._refusal(exc)
                if drop:
                    line.drop()
                raise error from None

    def close(self) -> None:
        for line in self._lines:
            with line.lock:
                line.drop()
