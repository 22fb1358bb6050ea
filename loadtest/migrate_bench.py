"""``cryptd migrate`` against the service's batch rewrap alone, same run, same key pair.

    python -m loadtest.migrate_bench             # 1,000,000 rows AES-256-GCM -> SM4-GCM and
                                                 # 100,000 rows RSA-2048 -> SM2, in SQLite and
                                                 # PostgreSQL, 2 rounds (about an hour here)
    python -m loadtest.migrate_bench --quick     # smoke run: small tables, one round

For each database and key pair the table is built once from tokens the service made, then
each round measures, in alternating order:

- **rewrap alone**: the same tokens, held in memory, sent to batch ``rewrap`` with ``to_key``
  by the project's client with the tool's batch size and concurrency, results discarded: what
  the service sustains when nothing else is done;
- **cryptd migrate**: the command itself on a fresh copy of the table (read, rewrap, write
  back in transactions, checkpoint after every page); its rate is the report's (from the first
  page to the last commit), and the whole command's wall time is printed beside it.

The goal is a ratio of at least 0.80. Beside it: CPU seconds per 1,000 rows of the server and
of the client side (how much of the shared cores each used), the tool's peak RSS, and the CPU
the rest of the machine used meanwhile (other work on the shared cores makes a run noisy).
``--memory`` measures the tool's peak RSS against table size (SQLite, AES rows);
``--writers`` measures only the database side of each PostgreSQL update strategy.
Results go to ``loadtest/results/migrate-<time>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptd_client import CryptdClient
from loadtest.procstat import CpuWindow, PeakRss, others_load
from loadtest.targets import Cryptd

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=test"
PAIRS = {"aes": ("aes256-gcm", "sm4-gcm"), "rsa": ("rsa-2048", "sm2")}
GOAL = 0.80  # cryptd migrate's rows/s over rewrap alone's


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- tokens and tables ------------------------------------------------------------------------


def make_tokens(client: CryptdClient, key: str, count: int, concurrency: int) -> list[str]:
    """``count`` tokens of 32-byte random plaintexts under ``key`` (batch encrypt)."""
    chunks = [min(1000, count - start) for start in range(0, count, 1000)]

    def one(size: int) -> list[str]:
        results = client.encrypt_batch(key, [os.urandom(32) for _ in range(size)])
        return [r.ciphertext for r in results if not isinstance(r, Exception)]

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = [t for chunk in pool.map(one, chunks) for t in chunk]
    if len(tokens) != count:
        raise RuntimeError("encryption failed for some rows")
    return tokens


class Database:
    """A table ``t(id BIGINT PRIMARY KEY, tok TEXT)`` that can be reset to the original tokens."""

    kind: str
    url: str

    def load(self, tokens: Sequence[str]) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def under(self, type_id: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SqliteDatabase(Database):
    kind = "sqlite"

    def __init__(self, directory: Path) -> None:
        self.original = directory / "original.db"
        self.path = directory / "table.db"
        self.url = f"sqlite:///{self.path}"

    def load(self, tokens: Sequence[str]) -> None:
        self.original.unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(self.original)) as db:
            db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, tok TEXT NOT NULL)")
            db.executemany("INSERT INTO t VALUES (?, ?)", enumerate(tokens, 1))
            db.commit()

    def reset(self) -> None:
        shutil.copyfile(self.original, self.path)

    def under(self, type_id: int) -> int:
        with contextlib.closing(sqlite3.connect(self.path)) as db:
            return _count_type(type_id, (row[0] for row in db.execute("SELECT tok FROM t")))

    def close(self) -> None:
        pass


class PostgresDatabase(Database):
    kind = "postgresql"

    def __init__(self) -> None:
        import psycopg

        self.name = f"cryptd_bench_{uuid.uuid4().hex[:10]}"
        self._admin = psycopg.connect(PG_ADMIN, autocommit=True)
        self._admin.execute(f'CREATE DATABASE "{self.name}"')
        self.url = f"postgresql://postgres@127.0.0.1:5432/{self.name}"
        self._db = psycopg.connect(
            f"host=127.0.0.1 port=5432 user=postgres dbname={self.name}", autocommit=True
        )

    def load(self, tokens: Sequence[str]) -> None:
        self._db.execute("DROP TABLE IF EXISTS original")
        self._db.execute("CREATE TABLE original (id BIGINT PRIMARY KEY, tok TEXT NOT NULL)")
        with self._db.cursor() as cursor, cursor.copy("COPY original FROM STDIN") as copy:
            for row in enumerate(tokens, 1):
                copy.write_row(row)

    def reset(self) -> None:
        self._db.execute("DROP TABLE IF EXISTS t")
        self._db.execute("CREATE TABLE t (id BIGINT PRIMARY KEY, tok TEXT NOT NULL)")
        self._db.execute("INSERT INTO t SELECT * FROM original")
        self._db.execute("VACUUM ANALYZE t")

    def under(self, type_id: int) -> int:
        with self._db.cursor(name="scan") as cursor:
            self._db.autocommit = False
            try:
                cursor.execute("SELECT tok FROM t")
                return _count_type(type_id, (row[0] for row in cursor))
            finally:
                self._db.rollback()
                self._db.autocommit = True

    def close(self) -> None:
        self._db.close()
        self._admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        self._admin.close()


def _count_type(type_id: int, tokens: Iterator[str]) -> int:
    from service.migrate.tokens import type_id as token_type

    return sum(1 for token in tokens if token_type(token) == type_id)


# -- the two measurements -----------------------------------------------------------------------


@dataclass
class Run:
    what: str  # "rewrap" | "migrate"
    rows: int
    seconds: float  # the rate's window
    wall: float  # the whole command (migrate) or the same window (rewrap)
    server_cpu: float | None
    client_cpu: float
    others_cpu: float
    peak_rss_mb: float | None = None

    @property
    def rate(self) -> float:
        return self.rows / self.seconds


def rewrap_alone(
    client: CryptdClient, server: Cryptd, pair: tuple[str, str], tokens: Sequence[str], args: Any
) -> Run:
    """The tool's own request layer (the same client, request sizes, retries and halving on
    503), without the database, the checkpoint or anything else."""
    from service.migrate.service import KeyInfo, Rewrapper

    source, target = pair
    rewrapper = Rewrapper(
        client, KeyInfo(source, None, None, None), KeyInfo(target, None, None, None)
    )
    pages = [tokens[i : i + args.batch_size] for i in range(0, len(tokens), args.batch_size)]

    def one(page: Sequence[str]) -> int:
        items = [{"ciphertext": t, "to_key": target} for t in page]
        results = rewrapper._send(client.rewrap_batch, source, items)
        return sum(1 for r in results if not isinstance(r, Exception))

    with CpuWindow(server.pids, "self") as window:
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            done = sum(pool.map(one, pages))
        seconds = time.monotonic() - started
    if done != len(tokens):
        raise RuntimeError(f"rewrap alone: {len(tokens) - done} items failed")
    usage = window.usage
    assert usage is not None
    return Run("rewrap", done, seconds, seconds, usage.server, usage.client, usage.others)


def migrate_command(
    server: Cryptd, pair: tuple[str, str], url: str, args: Any, *extra: str
) -> list[str]:
    return [
        sys.executable, "-m", "service", "migrate", "--credential", str(server.credentials),
        "--from-key", pair[0], "--to-key", pair[1], "--url", url, "--table", "t",
        "--column", "tok", "--id-column", "id", "--batch-size", str(args.batch_size),
        "--concurrency", str(args.concurrency), "--no-progress", "--json", *extra,
    ]  # fmt: skip


def run_tool(
    command: list[str], server: Cryptd | None, checkpoint: Path
) -> tuple[Run, dict[str, Any]]:
    """Run ``cryptd migrate``; its rate from the report, its peak RSS from /proc (wait4()'s
    would include this process's own, which holds the table's tokens)."""
    checkpoint.unlink(missing_ok=True)
    checkpoint.with_name(checkpoint.name + ".failures.jsonl").unlink(missing_ok=True)
    command = [*command, "--checkpoint", str(checkpoint)]
    with (
        tempfile.TemporaryFile() as out,
        CpuWindow(server.pids if server else None, "children") as window,
    ):
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE)
        assert process.stderr is not None
        with PeakRss(process.pid) as peak:
            err = process.stderr.read()
            _, status, _ = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        out.seek(0)
        text = out.read().decode()
    if process.returncode != 0:
        raise RuntimeError(f"cryptd migrate exited {process.returncode}: {err.decode()[-2000:]}")
    report = json.loads(text)
    usage = window.usage
    assert usage is not None
    rows, seconds = report["run"]["rows"], report["run"]["elapsed"]
    run = Run(
        "migrate",
        rows,
        seconds,
        wall,
        usage.server,
        usage.client,
        usage.others,
        peak_rss_mb=peak.mib,
    )
    return run, report


# -- the plan -------------------------------------------------------------------------------------


@dataclass
class Case:
    database: str
    pair: str
    rows: int
    runs: list[Run]

    def rates(self, what: str) -> list[float]:
        return [r.rate for r in self.runs if r.what == what]

    @property
    def ratio(self) -> float:
        return statistics.median(self.rates("migrate")) / statistics.median(self.rates("rewrap"))


def _per_k(value: float | None, rows: int) -> str:
    return "-" if value is None else f"{value / rows * 1000:.3f}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(
    cases: Sequence[Case], memory: Sequence[dict[str, Any]], writers: Sequence[dict[str, Any]]
) -> str:
    lines = [
        "| database | key pair | rows | rewrap alone rows/s | cryptd migrate rows/s | ratio | "
        "server CPU s/1k rows (rewrap / migrate) | client CPU s/1k rows (rewrap / migrate) | "
        "tool peak RSS MB | others' cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        rewrap = [r for r in case.runs if r.what == "rewrap"]
        tool = [r for r in case.runs if r.what == "migrate"]
        others = statistics.mean(r.others_cpu / r.wall for r in case.runs)
        lines.append(
            f"| {case.database} | {PAIRS[case.pair][0]} -> {PAIRS[case.pair][1]} | {case.rows:,} | "
            f"{statistics.median(case.rates('rewrap')):,.0f} | "
            f"{statistics.median(case.rates('migrate')):,.0f} | **{case.ratio:.2f}** | "
            f"{_per_k(statistics.median(r.server_cpu or 0 for r in rewrap), case.rows)} / "
            f"{_per_k(statistics.median(r.server_cpu or 0 for r in tool), case.rows)} | "
            f"{_per_k(statistics.median(r.client_cpu for r in rewrap), case.rows)} / "
            f"{_per_k(statistics.median(r.client_cpu for r in tool), case.rows)} | "
            f"{_mb(max((r.peak_rss_mb or 0 for r in tool), default=0) or None)} | {others:.2f} |"
        )
    if memory:
        lines += ["", "| table rows (SQLite, AES) | tool peak RSS MB | rows/s |", "|---|---|---|"]
        lines += [f"| {m['rows']:,} | {_mb(m['peak_rss_mb'])} | {m['rate']:,.0f} |" for m in memory]
    if writers:
        lines += [
            "",
            "| PostgreSQL writer (database side only) | rows/s | tool CPU µs/row | "
            "PostgreSQL backend CPU µs/row |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {w['writer']} | {w['rate']:,.0f} | {w['tool_us_per_row']:.1f} | "
            f"{w['backend_us_per_row']:.1f} |"
            for w in writers
        ]
    return "\n".join(lines)


@contextlib.contextmanager
def database(kind: str, directory: Path) -> Iterator[Database]:
    db: Database = SqliteDatabase(directory) if kind == "sqlite" else PostgresDatabase()
    try:
        yield db
    finally:
        db.close()


def measure_case(
    server: Cryptd,
    client: CryptdClient,
    db: Database,
    pair_name: str,
    tokens: list[str],
    args: Any,
    work: Path,
) -> Case:
    from service.crypto.registry import KEY_TYPES

    pair = PAIRS[pair_name]
    target_id = KEY_TYPES[pair[1]].type_id
    db.load(tokens)
    case = Case(db.kind, pair_name, len(tokens), [])
    for round_no in range(args.rounds):
        order = ("rewrap", "migrate") if round_no % 2 == 0 else ("migrate", "rewrap")
        for what in order:
            log(f"  round {round_no + 1}: {what} ({db.kind}, {pair_name}, {len(tokens):,} rows)")
            if what == "rewrap":
                run = rewrap_alone(client, server, pair, tokens, args)
            else:
                db.reset()
                command = migrate_command(server, pair, db.url, args)
                run, _ = run_tool(command, server, work / "bench.ckpt")
                migrated = db.under(target_id)
                if migrated != len(tokens):
                    raise RuntimeError(f"{len(tokens) - migrated} rows were not migrated")
            log(f"    {run.rate:,.0f} rows/s (others used {run.others_cpu / run.wall:.2f} cores)")
            case.runs.append(run)
    return case


def measure_memory(
    server: Cryptd, client: CryptdClient, sizes: Sequence[int], args: Any, work: Path
) -> list[dict[str, Any]]:
    results = []
    tokens = make_tokens(client, PAIRS["aes"][0], max(sizes), args.concurrency)
    for size in sizes:
        db = SqliteDatabase(work)
        db.load(tokens[:size])
        db.reset()
        run, _ = run_tool(
            migrate_command(server, PAIRS["aes"], db.url, args), server, work / "m.ckpt"
        )
        log(f"  memory: {size:,} rows -> peak RSS {_mb(run.peak_rss_mb)} MB")
        results.append({"rows": size, "peak_rss_mb": run.peak_rss_mb, "rate": run.rate})
    return results


def measure_writers(client: CryptdClient, rows: int, args: Any) -> list[dict[str, Any]]:
    """The database side of each PostgreSQL strategy: read pages, write a new token per row
    (no service), groups of four pages per transaction as the tool writes them under a fast
    service. CPU of this thread (the tool's side) and of the PostgreSQL backend serving it."""
    from loadtest.procstat import tree_cpu_seconds
    from service.migrate.sql import SqlSource

    tokens = make_tokens(client, PAIRS["aes"][0], rows, args.concurrency)
    results = []
    db = PostgresDatabase()
    try:
        db.load(tokens)
        for writer in ("postgresql", "pg-copy", "pg-executemany", "generic"):
            db.reset()
            source = SqlSource(db.url, "t", "tok", "id", writer=writer)
            source.start(None)
            backend = source._conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            source._conn.commit()
            backend_cpu, tool_cpu = tree_cpu_seconds(backend), time.thread_time()
            started = time.monotonic()
            done = False
            while not done:
                group = []
                for _ in range(4):
                    page = source.read(args.batch_size)
                    if page is None:
                        done = True
                        break
                    new = [
                        (i, t[:-1] + ("A" if t[-1] != "A" else "B"))
                        for i, t in enumerate(page.tokens)
                        if t
                    ]
                    group.append((page, new))
                if group:
                    source.write(group, lambda _c, _w: None)
            seconds = time.monotonic() - started
            tool_cpu = time.thread_time() - tool_cpu
            backend_cpu = tree_cpu_seconds(backend) - backend_cpu
            source.close()
            result = {
                "writer": writer,
                "rate": rows / seconds,
                "tool_us_per_row": tool_cpu / rows * 1e6,
                "backend_us_per_row": backend_cpu / rows * 1e6,
            }
            log(f"  writer {writer}: {result}")
            results.append(result)
    finally:
        db.close()
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small tables, one round")
    parser.add_argument("--aes-rows", type=int, default=1_000_000)
    parser.add_argument("--rsa-rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--pairs", default="aes,rsa")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="cryptd server workers")
    parser.add_argument(
        "--memory", default="", help="table sizes for peak RSS, e.g. 10000,100000,1000000"
    )
    parser.add_argument(
        "--writers", type=int, default=0, help="rows for the PostgreSQL writer comparison"
    )
    parser.add_argument("--out", type=Path, help="JSON results (default: loadtest/results/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.aes_rows, args.rsa_rows, args.rounds = 20_000, 2_000, 1
    return args


def _names(listed: str) -> list[str]:
    """A comma-separated option; empty (``--pairs ''``) runs none, e.g. for ``--memory`` alone."""
    return [name for name in listed.split(",") if name]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y%m%dT%H%M%S")
    with tempfile.TemporaryDirectory(prefix="cryptd-migrate-bench-") as tmp:
        work = Path(tmp)
        server = Cryptd(work / "server", workers=args.workers)
        server.start()
        try:
            client = CryptdClient.from_file(
                server.credentials, timeout=120.0, retries=4, max_total_wait=60.0
            )
            log(f"cryptd at {server.url}; machine load from others {others_load():.2f} cores")
            cases: list[Case] = []
            for pair_name in _names(args.pairs):
                rows = args.aes_rows if pair_name == "aes" else args.rsa_rows
                log(f"making {rows:,} {PAIRS[pair_name][0]} tokens")
                tokens = make_tokens(client, PAIRS[pair_name][0], rows, args.concurrency)
                for kind in _names(args.databases):
                    with database(kind, work) as db:
                        cases.append(
                            measure_case(server, client, db, pair_name, tokens, args, work)
                        )
                del tokens
            sizes = [int(s) for s in args.memory.split(",") if s]
            memory = measure_memory(server, client, sizes, args, work) if sizes else []
            writers = measure_writers(client, args.writers, args) if args.writers else []
            client.close()
        finally:
            server.stop()
    table = render(cases, memory, writers)
    print(table)
    out = args.out or ROOT / "loadtest" / "results" / f"migrate-{started}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "started": started,
        "arguments": {k: str(v) for k, v in vars(args).items()},
        "cases": [{**asdict(c), "ratio": c.ratio, "goal_met": c.ratio >= GOAL} for c in cases],
        "memory": memory,
        "writers": writers,
        "table": table,
    }
    out.write_text(json.dumps(document, indent=1))
    short = [f"{c.database}/{c.pair} {c.ratio:.2f}" for c in cases if c.ratio < GOAL]
    if cases:
        log(f"goal (ratio >= {GOAL}): {'missed by ' + ', '.join(short) if short else 'met'}")
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
