"""The PostgreSQL key store: the keyring document as rows, shared by every replica.

Three tables for the keyring and one for usage counters (created by ``cryptd keystore init``,
never by the service, which needs only SELECT, INSERT, UPDATE and DELETE on them; docs/DEPLOY.md
has the grants):

- ``cryptd_keyring``: one row, the document's header: format, deployment id, master key id,
  generation, MAC (and the schema version);
- ``cryptd_keys``: one row per key, its metadata as JSON;
- ``cryptd_key_versions``: one row per version, its metadata as JSON and its wrapped material;
- ``cryptd_key_usage``: operation counts per key version (service/usage/postgres.py), not part
  of the document;
- ``cryptd_approvals``: one row per dual-control approval (the document's ``approvals``,
  service/keys/approvals.py). A store made before it lacks the table: it reads as having no
  approvals, and recording one is refused until ``cryptd keystore schema`` adds it.

Put back together, the rows are exactly the keyring file's document, so the MAC the integrity
layer checks is the same in both stores and a file keyring moves here unchanged. A change is
one transaction that first locks the header row (``SELECT ... FOR UPDATE``): writers of every
replica queue there, each reads what the one before committed, so two replicas rotating one
key at once get two distinct versions and lose neither. The commit sends ``NOTIFY`` on
:data:`CHANNEL` with the new generation and the names of the keys whose rows it wrote (when
they fit, :func:`notice_payload`); every server worker listens (and checks the generation
periodically, the backstop for a missed notification or a dropped connection), reads the
header and those keys' rows only (:meth:`PostgresKeyStore.read_keys`; the integrity layer
verifies the MAC over the whole document put back together, and a worker reads everything
when it fails), and answers on :data:`REPLICAS_CHANNEL` once its host enforces it
(service/keys/propagation.py).

One module over 400 lines: the schema, the rows read back as a document and a change written
as rows are one mapping, and splitting it would put the two halves of that mapping apart.

Driver: psycopg 3 (libpq): every libpq parameter in the URL (``sslmode``, ``sslrootcert``,
``target_session_attrs``, ...) and the ``PG*`` environment work as with ``psql``; it has a
blocking API for the key manager's threads and an asynchronous one for LISTEN. Measured
against asyncpg in loadtest/pg_drivers.py (docs/DEPLOY.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, Collection, Hashable, Iterator
from typing import Any

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb, set_json_loads

from service.keys.document import RawDocument
from service.keys.store import (
    Announced,
    Changed,
    CommitUnconfirmed,
    IntegrityError,
    Notice,
    NotInitialised,
    ServerClock,
    StoreUnavailable,
)
from service.pgconn import PostgresStore, Refusal, reason

log = logging.getLogger("cryptd.keystore")

SCHEMA_VERSION = 1
CHANNEL = "cryptd_keyring"
# Replicas announce the keyring generation they enforce here (service/keys/propagation.py).
REPLICAS_CHANNEL = "cryptd_replicas"
_REPLICA_ID = re.compile(r"[0-9a-f]{32}")
# A stored key name (service/keys/keyring.py: a user name, or an internal one)
_KEY_NAME = re.compile(r"(?:cryptd:)?[A-Za-z0-9_.-]{1,128}")
CLOCK_REFERENCE = "PostgreSQL clock_timestamp()"  # the server's clock, read by announcements
LOCK_CLASS = 0x63727970  # advisory lock namespace ("cryp"); the purpose is hashed into the key

LOCK_TIMEOUT = "30s"  # a writer waits this long for the changes queued before it
STATEMENT_TIMEOUT = "60s"
# A writer holds the header row's lock from its first statement to its commit. Should its
# process freeze or its host drop off the network between two statements, the server would
# keep that session, and the lock every replica's writers queue for, until its TCP keepalive
# gave up (two hours by default): it ends the session after this long idle instead. A live
# writer spends milliseconds between statements (a master-key rotation rewrapping 10,000
# versions, well under a second).
IDLE_IN_TRANSACTION_TIMEOUT = "10s"
# The three for the writer's transaction only (``true``: local), in one round trip.
_WRITER_TIMEOUTS = (
    f"SELECT set_config('lock_timeout', '{LOCK_TIMEOUT}', true),"
    f" set_config('statement_timeout', '{STATEMENT_TIMEOUT}', true),"
    f" set_config('idle_in_transaction_session_timeout', '{IDLE_IN_TRANSACTION_TIMEOUT}', true)"
)
# A notification's payload must stay under 8000 bytes; a change naming more than this many
# bytes of keys (a master-key rotation, a restore) says "everything" (the generation alone).
NOTICE_NAMES_BYTES = 7000
LISTEN_KEEPALIVE = 30.0  # seconds without a notification before the connection is probed
RECONNECT_DELAY = (0.2, 10.0)

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS cryptd_keyring (
        id smallint PRIMARY KEY CHECK (id = 1),
        schema_version integer NOT NULL,
        format text NOT NULL,
        deployment_id text NOT NULL,
        master_key_id text NOT NULL,
        generation bigint NOT NULL CHECK (generation > 0),
        mac bytea NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS cryptd_keys (
        name text PRIMARY KEY,
        record jsonb NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS cryptd_key_versions (
        name text NOT NULL REFERENCES cryptd_keys (name) ON DELETE CASCADE,
        version integer NOT NULL CHECK (version > 0),
        record jsonb NOT NULL,
        material bytea NOT NULL,
        PRIMARY KEY (name, version)
    )""",
    # Usage counters (service/usage/postgres.py): in the same database so that one init and
    # one set of grants cover them, but outside the keyring document and its MAC; no foreign
    # key, so a flush never waits on a key change, and key_created tells a key created again
    # under a deleted name from the old one.
    """CREATE TABLE IF NOT EXISTS cryptd_key_usage (
        name text NOT NULL,
        key_created text NOT NULL,
        version integer NOT NULL CHECK (version > 0),
        operation text NOT NULL,
        count bigint NOT NULL CHECK (count >= 0),
        last_used_at timestamptz NOT NULL,
        PRIMARY KEY (name, key_created, version, operation)
    )""",
    """CREATE TABLE IF NOT EXISTS cryptd_approvals (
        id text PRIMARY KEY,
        record jsonb NOT NULL
    )""",
)
TABLES = (
    "cryptd_keyring",
    "cryptd_keys",
    "cryptd_key_versions",
    "cryptd_key_usage",
    "cryptd_approvals",
)
HEADER = "SELECT schema_version, format, deployment_id, master_key_id, generation, mac"
_VERSIONS = "SELECT name, version, record, material FROM cryptd_key_versions"
# (keys, versions): every row, or the rows of the keys named
_ALL_KEYS = ("SELECT name, record FROM cryptd_keys", f"{_VERSIONS} ORDER BY name, version")
_NAMED_KEYS = (
    "SELECT name, record FROM cryptd_keys WHERE name = ANY(%s)",
    f"{_VERSIONS} WHERE name = ANY(%s) ORDER BY name, version",
)


class PostgresKeyStore(PostgresStore):
    backend = "postgresql"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        # Key and version rows this store has read (for tests and loadtest/refresh_cost.py:
        # what a notification costs a reader).
        self.rows_read = 0
        self._server_clock: ServerClock | None = None  # the last announcement's reading
        # Announcements keep this host's lease (service/keys/lease.py): on a connection of
        # their own, they never wait for a key change queued behind another replica's (up to
        # LOCK_TIMEOUT, six leases), so a change waiting its turn never stops keys being served.
        self._announcing = self._line()

    def _connect(self) -> psycopg.Connection[Any]:
        conn = super()._connect()
        set_json_loads(orjson.loads, conn)
        return conn

    def _refusal(self, exc: psycopg.Error) -> Refusal:
        if isinstance(exc, pg_errors.UndefinedTable | pg_errors.UndefinedColumn):
            return NotInitialised(
                f"{self._description} has no cryptd key store (run `cryptd keystore init`)"
            ), False
        if isinstance(exc, pg_errors.InsufficientPrivilege):
            return StoreUnavailable(
                f"{self._description}: permission denied ({reason(exc)})"
            ), False
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            unreachable = f"the database {self._description} is unreachable ({reason(exc)})"
            return StoreUnavailable(unreachable), True
        if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
            return IntegrityError(f"malformed rows in the key store ({reason(exc)})"), False
        return StoreUnavailable(f"{self._description}: {reason(exc)}"), True

    # The interface --------------------------------------------------------------------------

    def stamp(self) -> Hashable:
        with self._session() as conn:
            row = conn.execute(
                "SELECT schema_version, generation, mac FROM cryptd_keyring WHERE id = 1"
            ).fetchone()
        if row is None:
            return None
        _check_schema(row[0])
        return (row[1], bytes(row[2]))

    def read(self) -> RawDocument | None:
        with self._session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            document = _read(conn)
        self._count(document, None)
        return document

    def read_keys(self, base: RawDocument, names: Collection[str]) -> RawDocument | None:
        wanted = sorted(set(names))
        with self._session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            document = _read(conn, wanted)
        if document is None:
            return None
        self._count(document, wanted)
        # Every key ``names`` does not name, as ``base`` had it (shared, never changed: the
        # parse reuses what it parsed from them); the named ones as stored now, or gone.
        keys = {name: record for name, record in base.get("keys", {}).items() if name not in names}
        keys.update(document["keys"])
        document["keys"] = keys
        return document

    def _count(self, document: RawDocument | None, names: list[str] | None) -> None:
        if document is not None:
            keys = document["keys"]
            chosen = keys.values() if names is None else [keys[n] for n in names if n in keys]
            self.rows_read += sum(1 + len(key["versions"]) for key in chosen)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_PgTransaction]:
        """One change. Its commit waits for the synchronous standby; should that wait be
        cancelled (the statement timeout, with the standby gone), PostgreSQL commits on the
        primary alone and only warns: that change is refused as :class:`CommitUnconfirmed`,
        never acknowledged as if it were on both."""
        with self._session() as conn:
            warnings: list[str | None] = []  # their SQLSTATEs

            def heard(notice: psycopg.errors.Diagnostic) -> None:
                warnings.append(notice.sqlstate)  # read now: the notice is gone afterwards

            conn.add_notice_handler(heard)
            try:
                with conn.transaction():
                    conn.execute(_WRITER_TIMEOUTS)
                    locked = conn.execute("SELECT 1 FROM cryptd_keyring WHERE id = 1 FOR UPDATE")
                    if locked.fetchone() is None:
                        # An empty store being initialised: one initialiser at a time.
                        conn.execute("LOCK TABLE cryptd_keyring IN SHARE ROW EXCLUSIVE MODE")
                    yield _PgTransaction(conn)
                    warnings.clear()  # what the server says from here on is about the commit
            finally:
                conn.remove_notice_handler(heard)
            # SQLSTATE 01000 (a plain WARNING) is all the commit may say: the message is
            # translated with the server's lc_messages, so it is not matched.
            if "01000" in warnings:
                raise CommitUnconfirmed(
                    f"{self._description}: the change was committed on the primary, but the "
                    "synchronous standby did not confirm it in time"
                )

    @contextlib.contextmanager
    def try_lock(self, purpose: str) -> Iterator[bool]:
        """A session advisory lock on a connection of its own, so that holding it (a
        rotation generating keys) never blocks this process's other store calls."""
        try:
            conn = self._connect()
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"the database {self._description} is unreachable ({reason(exc)})"
            ) from None
        with conn:
            try:
                row = conn.execute(
                    "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (LOCK_CLASS, purpose)
                ).fetchone()
            except psycopg.Error as exc:
                raise StoreUnavailable(f"{self._description}: {reason(exc)}") from None
            held = bool(row and row[0])
            try:
                yield held
            finally:
                if held:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute(
                            "SELECT pg_advisory_unlock(%s, hashtext(%s))", (LOCK_CLASS, purpose)
                        )

    def notifications(self) -> AsyncGenerator[Notice, None]:
        return self._listen()

    def announce(self, replica: str, generation: int) -> None:
        """The announcement also reads the server's clock (``clock_timestamp()``, in the same
        statement): a reference for this host's clock every heartbeat, at no extra round trip."""
        with self._session(self._announcing) as conn:
            sent = time.monotonic()
            row = conn.execute(
                "SELECT pg_notify(%s, %s), extract(epoch FROM clock_timestamp())::float8",
                (REPLICAS_CHANNEL, f"{replica} {generation}"),
            ).fetchone()
            round_trip = time.monotonic() - sent
        if row is not None:
            self._server_clock = ServerClock(CLOCK_REFERENCE, float(row[1]), sent, round_trip)

    def server_clock(self) -> ServerClock | None:
        return self._server_clock

    def remove_leftovers(self) -> int:
        return 0  # a transaction that dies is rolled back: nothing is left behind

    async def _listen(self) -> AsyncGenerator[Notice, None]:
        """LISTEN on a connection of its own, reconnecting with backoff; yields ``Changed(None)``
        after each (re)connection (changes may have been missed), then one notice per
        notification."""
        delay = RECONNECT_DELAY[0]
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
            except psycopg.Error as exc:
                log.warning("key store notifications unavailable", extra={"reason": reason(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_DELAY[1])
                continue
            try:
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    await conn.execute(f"LISTEN {REPLICAS_CHANNEL}")
                    delay = RECONNECT_DELAY[0]
                    yield Changed()
                    while True:
                        async for notify in conn.notifies(timeout=LISTEN_KEEPALIVE):
                            notice = parse_notice(notify.channel, notify.payload)
                            if notice is not None:
                                yield notice
                        await conn.execute("SELECT 1")  # quiet for a while: still connected?
            except psycopg.Error as exc:
                log.warning("key store notifications interrupted", extra={"reason": reason(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_DELAY[1])

    # Administration (`cryptd keystore init`, tests) ------------------------------------------

    def create_schema(self) -> None:
        with self._session() as conn, conn.transaction():
            for statement in SCHEMA:
                conn.execute(statement)


def notice_payload(generation: int, names: Collection[str]) -> str:
    """``"G keys NAME NAME ..."``: the change to generation G wrote (or removed) those keys'
    rows; ``"G"`` alone when they do not fit in a notification (read everything). Key names
    have no spaces (service/keys/keyring.py); a cryptd before this reads either as "changed,
    generation unknown" and reads everything, as it did."""
    named = " ".join(["keys", *sorted(names)])
    if len(named) > NOTICE_NAMES_BYTES:
        return str(generation)
    return f"{generation} {named}"


def parse_notice(channel: str, payload: str) -> Notice | None:
    """A notification as a notice; None for one that is not cryptd's (ignored, never trusted
    beyond "look at the store": a generation only makes a worker read and verify it, and names
    only which rows it reads first)."""
    if channel == CHANNEL:
        generation, _, rest = payload.partition(" ")
        if not generation.isdigit():
            return Changed()
        words = rest.split(" ")
        if words[0] != "keys" or not all(_KEY_NAME.fullmatch(w) for w in words[1:]):
            return Changed(int(generation))
        return Changed(int(generation), frozenset(words[1:]))
    if channel == REPLICAS_CHANNEL:
        replica, _, generation = payload.partition(" ")
        if _REPLICA_ID.fullmatch(replica) and generation.isdigit():
            return Announced(replica, int(generation))
    return None


def _check_schema(version: int) -> None:
    if version != SCHEMA_VERSION:
        raise IntegrityError(
            f"the key store has schema version {version}; this cryptd reads {SCHEMA_VERSION}"
        )


def _read(conn: psycopg.Connection[Any], names: list[str] | None = None) -> RawDocument | None:
    """The document's header, approvals and keys: every key, or only those of ``names`` that
    are stored (the caller puts the others back)."""
    header = conn.execute(HEADER + " FROM cryptd_keyring WHERE id = 1").fetchone()
    if header is None:
        return None
    schema_version, fmt, deployment_id, master_key_id, generation, mac = header
    _check_schema(schema_version)
    key_query, version_query = _ALL_KEYS if names is None else _NAMED_KEYS
    params = () if names is None else (names,)
    keys: dict[str, dict[str, Any]] = {}
    # Binary results: bytea arrives as bytes, not hex text (half the snapshot's CPU here).
    for name, record in conn.execute(key_query, params, binary=True):
        if not isinstance(record, dict) or "versions" in record:
            raise IntegrityError(f"malformed row in cryptd_keys (key {str(name)[:128]!r})")
        keys[name] = {**record, "versions": []}
    rows = conn.execute(version_query, params, binary=True)
    for name, version, record, material in rows:
        where = f"key {str(name)[:128]!r} version {version}"
        if name not in keys:
            raise IntegrityError(f"malformed rows in cryptd_key_versions ({where} has no key)")
        if not isinstance(record, dict) or {"version", "material"} & set(record):
            raise IntegrityError(f"malformed row in cryptd_key_versions ({where})")
        keys[name]["versions"].append(
            {**record, "version": version, "material": base64.b64encode(material).decode()}
        )
    document: RawDocument = {
        "format": fmt,
        "deployment_id": deployment_id,
        "generation": generation,
        "master_key_id": master_key_id,
        "keys": keys,
        "mac": base64.b64encode(mac).decode(),
    }
    approvals: dict[str, Any] = {}
    if _has_approvals_table(conn):
        for approval_id, record in conn.execute("SELECT id, record FROM cryptd_approvals"):
            approvals[approval_id] = record
    if approvals:  # written only when there are some, as in the keyring file
        document["approvals"] = approvals
    return document


def _has_approvals_table(conn: psycopg.Connection[Any]) -> bool:
    found = conn.execute("SELECT to_regclass('cryptd_approvals') IS NOT NULL").fetchone()
    return bool(found and found[0])


def _write_approvals(
    conn: psycopg.Connection[Any], old: dict[str, Any], new: dict[str, Any]
) -> None:
    if not old and not new:
        return
    if not _has_approvals_table(conn):
        raise StoreUnavailable(
            "the key store has no cryptd_approvals table (made before dual control): run "
            "`cryptd keystore schema --grant-to ROLE | psql` as its owner once"
        )
    gone = [approval_id for approval_id in old if approval_id not in new]
    if gone:
        conn.execute("DELETE FROM cryptd_approvals WHERE id = ANY(%s)", (gone,))
    changed = [(a, Jsonb(record)) for a, record in new.items() if old.get(a) != record]
    if changed:
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO cryptd_approvals (id, record) VALUES (%s, %s) "
                "ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record",
                changed,
            )


class _PgTransaction:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._current: RawDocument | None = None
        self._read = False

    def read(self) -> RawDocument | None:
        self._current = _read(self._conn)
        self._read = True
        return self._current

    def write(self, document: RawDocument) -> None:
        """Write the rows that differ from what :meth:`read` saw, then notify (delivered to
        the listeners when the transaction commits)."""
        if not self._read:
            self.read()
        old = self._current
        conn = self._conn
        header = (
            document["format"],
            document["deployment_id"],
            document["master_key_id"],
            document["generation"],
            base64.b64decode(document["mac"]),
        )
        if old is None:
            conn.execute(
                "INSERT INTO cryptd_keyring (id, schema_version, format, deployment_id, "
                "master_key_id, generation, mac) VALUES (1, %s, %s, %s, %s, %s, %s)",
                (SCHEMA_VERSION, *header),
            )
        else:
            conn.execute(
                "UPDATE cryptd_keyring SET format = %s, deployment_id = %s, master_key_id = %s, "
                "generation = %s, mac = %s WHERE id = 1",
                header,
            )
        old_keys: dict[str, Any] = {} if old is None else old["keys"]
        new_keys: dict[str, Any] = document["keys"]
        gone = [name for name in old_keys if name not in new_keys]
        if gone:
            conn.execute("DELETE FROM cryptd_keys WHERE name = ANY(%s)", (gone,))
        key_rows = []
        version_rows = []
        dropped_versions = []
        for name, key in new_keys.items():
            record = {k: v for k, v in key.items() if k != "versions"}
            before = old_keys.get(name)
            if before is None or {k: v for k, v in before.items() if k != "versions"} != record:
                key_rows.append((name, Jsonb(record)))
            old_versions = {} if before is None else {v["version"]: v for v in before["versions"]}
            new_versions = {v["version"]: v for v in key["versions"]}
            for number, version in new_versions.items():
                if old_versions.get(number) != version:
                    meta = {k: v for k, v in version.items() if k not in ("version", "material")}
                    material = base64.b64decode(version["material"])
                    version_rows.append((name, number, Jsonb(meta), material))
            dropped_versions += [(name, n) for n in old_versions if n not in new_versions]
        with conn.cursor() as cursor:
            if key_rows:
                cursor.executemany(
                    "INSERT INTO cryptd_keys (name, record) VALUES (%s, %s) "
                    "ON CONFLICT (name) DO UPDATE SET record = EXCLUDED.record",
                    key_rows,
                )
            if dropped_versions:
                cursor.executemany(
                    "DELETE FROM cryptd_key_versions WHERE name = %s AND version = %s",
                    dropped_versions,
                )
            if version_rows:
                cursor.executemany(
                    "INSERT INTO cryptd_key_versions (name, version, record, material) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (name, version) DO UPDATE SET "
                    "record = EXCLUDED.record, material = EXCLUDED.material",
                    version_rows,
                )
        _write_approvals(
            conn, {} if old is None else old.get("approvals", {}), document.get("approvals", {})
        )
        # The readers' hint: these keys' rows are all that changed (approvals are read always).
        written = {*gone, *(row[0] for row in key_rows), *(row[0] for row in version_rows)}
        written.update(name for name, _ in dropped_versions)
        payload = notice_payload(document["generation"], written)
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
