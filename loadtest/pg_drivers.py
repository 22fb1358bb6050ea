"""psycopg 3 against asyncpg for what the PostgreSQL key store does, same run, alternating.

    pip install -e '.[postgresql]' asyncpg   # asyncpg only for this comparison
    python -m loadtest.pg_drivers [--url postgresql://postgres@127.0.0.1:5432/test]

Operations (each in a scratch schema of its own, dropped afterwards):

- ``stamp``: the periodic change check, one small query on an open connection;
- ``snapshot``: read a whole keyring of ``--keys`` keys with two versions each (the reload);
- ``write``: one change: lock the header row, insert a version, update the header, notify,
  commit;
- ``notify``: NOTIFY on one connection until the LISTEN on another has it.

Per operation: median wall time and process CPU per call over ``--rounds`` rounds that
alternate the drivers (psycopg sync, psycopg async, asyncpg), so the shared machine's noise
hits all of them alike. Prints a table and the ratios to psycopg's blocking API.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import psycopg
from psycopg.types.json import set_json_loads

SCHEMA = f"cryptd_driver_bench_{secrets.token_hex(4)}"  # every connection's search_path
CHANNEL = SCHEMA
SETUP = (
    "CREATE TABLE head (id int PRIMARY KEY, generation bigint, mac bytea)",
    "CREATE TABLE keys (name text PRIMARY KEY, record jsonb)",
    "CREATE TABLE versions (name text, version int, record jsonb, material bytea, "
    "PRIMARY KEY (name, version))",
)
STAMP = "SELECT generation, mac FROM head WHERE id = 1"
KEYS = "SELECT name, record FROM keys"
VERSIONS = "SELECT name, version, record, material FROM versions ORDER BY name, version"
LOCK = "SELECT 1 FROM head WHERE id = 1 FOR UPDATE"
INSERT = "INSERT INTO versions VALUES ($1, $2, $3, $4)"
BUMP = "UPDATE head SET generation = generation + 1, mac = $1 WHERE id = 1"


def pg(sql: str) -> str:
    """asyncpg's $n placeholders as psycopg's %s."""
    for n in range(9, 0, -1):
        sql = sql.replace(f"${n}", "%s")
    return sql


def scoped(url: str) -> str:
    return psycopg.conninfo.make_conninfo(url, options=f"-c search_path={SCHEMA}")


def populate(url: str, keys: int) -> None:
    record = psycopg.types.json.Jsonb(
        {"type": "rsa-2048", "created_at": "2026-01-01T00:00:00Z", "min_decryption_version": 1}
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
    with psycopg.connect(scoped(url), autocommit=True) as conn:
        for statement in SETUP:
            conn.execute(statement)
        conn.execute("INSERT INTO head VALUES (1, 1, %s)", (os.urandom(32),))
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO keys VALUES (%s, %s)",
                [(f"k{i:05d}", record) for i in range(keys)],
            )
            cursor.executemany(
                "INSERT INTO versions VALUES (%s, %s, %s, %s)",
                [
                    (
                        f"k{i:05d}",
                        v,
                        psycopg.types.json.Jsonb({"created_at": "2026-01-01T00:00:00Z"}),
                        os.urandom(1250),  # a wrapped RSA-2048 PKCS#8
                    )
                    for i in range(keys)
                    for v in (1, 2)
                ],
            )


class Timer:
    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def add(self, wall: float, cpu: float, calls: int) -> None:
        self.wall.append(wall / calls)
        self.cpu.append(cpu / calls)


async def timed(timer: Timer, calls: int, call: Callable[[], Awaitable[Any]]) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await call()
    timer.add(time.perf_counter() - wall, time.process_time() - cpu, calls)


def timed_sync(timer: Timer, calls: int, call: Callable[[], Any]) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    timer.add(time.perf_counter() - wall, time.process_time() - cpu, calls)


class PsycopgSync:
    name = "psycopg (blocking)"

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(scoped(url), autocommit=True)
        set_json_loads(orjson.loads, self.conn)  # as the store does; asyncpg gets it too
        self.listener = psycopg.connect(scoped(url), autocommit=True)
        self.listener.execute(f"LISTEN {CHANNEL}")
        self.counter = 10_000_000

    def stamp(self) -> None:
        self.conn.execute(STAMP).fetchone()

    def snapshot(self) -> None:
        with self.conn.transaction():
            self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            self.conn.execute(KEYS, binary=True).fetchall()
            self.conn.execute(VERSIONS, binary=True).fetchall()

    def write(self) -> None:
        self.counter += 1
        with self.conn.transaction():
            self.conn.execute(LOCK).fetchone()
            self.conn.execute(
                pg(INSERT),
                ("w", self.counter, psycopg.types.json.Jsonb({"c": 1}), b"\0" * 1250),
            )
            self.conn.execute(pg(BUMP), (os.urandom(32),))
            self.conn.execute("SELECT pg_notify(%s, 'x')", (CHANNEL + "_w",))

    def notify(self) -> None:
        self.conn.execute(f"NOTIFY {CHANNEL}")
        for _ in self.listener.notifies(stop_after=1, timeout=5):
            pass

    def close(self) -> None:
        self.conn.close()
        self.listener.close()


class PsycopgAsync:
    name = "psycopg (async)"
    conn: psycopg.AsyncConnection[Any]
    listener: psycopg.AsyncConnection[Any]
    counter: int

    @classmethod
    async def open(cls, url: str) -> PsycopgAsync:
        self = cls()
        self.conn = await psycopg.AsyncConnection.connect(scoped(url), autocommit=True)
        set_json_loads(orjson.loads, self.conn)
        self.listener = await psycopg.AsyncConnection.connect(scoped(url), autocommit=True)
        await self.listener.execute(f"LISTEN {CHANNEL}")
        self.counter = 20_000_000
        return self

    async def stamp(self) -> None:
        await (await self.conn.execute(STAMP)).fetchone()

    async def snapshot(self) -> None:
        async with self.conn.transaction():
            await self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            await (await self.conn.execute(KEYS, binary=True)).fetchall()
            await (await self.conn.execute(VERSIONS, binary=True)).fetchall()

    async def write(self) -> None:
        self.counter += 1
        async with self.conn.transaction():
            await (await self.conn.execute(LOCK)).fetchone()
            await self.conn.execute(
                pg(INSERT),
                ("w", self.counter, psycopg.types.json.Jsonb({"c": 1}), b"\0" * 1250),
            )
            await self.conn.execute(pg(BUMP), (os.urandom(32),))
            await self.conn.execute("SELECT pg_notify(%s, 'x')", (CHANNEL + "_w",))

    async def notify(self) -> None:
        await self.conn.execute(f"NOTIFY {CHANNEL}")
        async for _ in self.listener.notifies(stop_after=1, timeout=5):
            pass

    async def close(self) -> None:
        await self.conn.close()
        await self.listener.close()


class Asyncpg:
    name = "asyncpg"
    # asyncpg is optional and untyped here: its connections are Any.
    conn: Any
    listener: Any
    queue: asyncio.Queue[str]
    counter: int

    @classmethod
    async def open(cls, url: str) -> Asyncpg:
        import asyncpg

        self = cls()
        settings = {"search_path": SCHEMA}
        self.conn = await asyncpg.connect(url, server_settings=settings)
        await self.conn.set_type_codec(
            "jsonb",
            encoder=lambda v: orjson.dumps(v).decode(),
            decoder=orjson.loads,
            schema="pg_catalog",
        )
        self.listener = await asyncpg.connect(url, server_settings=settings)
        self.queue = asyncio.Queue()
        await self.listener.add_listener(CHANNEL, lambda *args: self.queue.put_nowait(args[-1]))
        self.counter = 30_000_000
        return self

    async def stamp(self) -> None:
        await self.conn.fetchrow(STAMP)

    async def snapshot(self) -> None:
        async with self.conn.transaction(isolation="repeatable_read", readonly=True):
            await self.conn.fetch(KEYS)
            await self.conn.fetch(VERSIONS)

    async def write(self) -> None:
        self.counter += 1
        async with self.conn.transaction():
            await self.conn.fetchrow(LOCK)
            await self.conn.execute(INSERT, "w", self.counter, {"c": 1}, b"\0" * 1250)
            await self.conn.execute(BUMP, os.urandom(32))
            await self.conn.execute("SELECT pg_notify($1, 'x')", CHANNEL + "_w")

    async def notify(self) -> None:
        await self.conn.execute(f"NOTIFY {CHANNEL}")
        await asyncio.wait_for(self.queue.get(), 5)

    async def close(self) -> None:
        await self.conn.close()
        await self.listener.close()


CALLS = {"stamp": 400, "snapshot": 3, "write": 60, "notify": 100}


async def main_async(args: argparse.Namespace) -> None:
    populate(args.url, args.keys)
    try:
        sync = PsycopgSync(args.url)
        drivers: list[Any] = [sync, await PsycopgAsync.open(args.url), await Asyncpg.open(args.url)]
        timers = {(d.name, op): Timer() for d in drivers for op in CALLS}
        for _ in range(args.rounds):
            for driver in drivers:
                for op, calls in CALLS.items():
                    call = getattr(driver, op)
                    if driver is sync:
                        timed_sync(timers[(driver.name, op)], calls, call)
                    else:
                        await timed(timers[(driver.name, op)], calls, call)
        print(f"{args.keys} keys x 2 versions, {args.rounds} alternating rounds, medians per call")
        print(f"{'operation':10} {'driver':20} {'wall ms':>9} {'cpu ms':>9} {'cpu vs psycopg':>15}")
        for op in CALLS:
            base = statistics.median(timers[(sync.name, op)].cpu)
            for driver in drivers:
                timer = timers[(driver.name, op)]
                wall, cpu = statistics.median(timer.wall), statistics.median(timer.cpu)
                print(
                    f"{op:10} {driver.name:20} {wall * 1e3:9.3f} {cpu * 1e3:9.3f} "
                    f"{cpu / base:14.2f}x"
                )
        sync.close()
        for driver in drivers[1:]:
            await driver.close()
    finally:
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
