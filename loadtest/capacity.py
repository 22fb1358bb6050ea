"""What one shard of each shared store serves, measured with cryptd's own store code:
``python -m loadtest.capacity [nonces|keystore|all]``.

``nonces``: nonce checks per second against one Redis (one shard) through
:class:`service.auth.replay.RedisReplayStore`, the Lua script and coalescer the servers run.
``--processes`` processes stand for server workers (each its own event loop, client and
coalescer) and keep N checks in flight each for ``--duration`` seconds, once for each N of
``--in-flight`` (1: no batching, a lightly loaded worker). Reported: checks/s, the mean batch
(one script call each), and Redis's own CPU per check (``INFO cpu`` before and after), whence the
checks/s one Redis core sustains: Redis runs scripts on one thread, so that is the shard's
ceiling whatever the clients do. A private ``redis-server`` is started unless ``--redis-url``
names one (its keys are under a prefix of the run's own, seeded with epoch 0, and expire).

``keystore``: key-store writes per second on PostgreSQL through
:class:`service.keys.manager.KeyManager` over the PostgreSQL store: ``--writers`` threads, each
with a manager and connection of its own as a replica has, change a key's rotation period (a new
keyring generation each: the whole document read, checked and written in one transaction,
as every key change is) in a keyring of ``--keys`` keys. Reported: writes/s and the write
latency P50/P99. A scratch database on ``--keystore-url``'s server is created and dropped.

Prints a Markdown table; the figures on a quiet machine go to docs/SCALE.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from loadtest.keystore import DEFAULT_URL, as_url, scratch_database
from loadtest.stores import private_redis
from service.auth.redis_client import connect
from service.auth.replay import SEED_SCRIPT, RedisReplayStore, StoreUnavailable

PREFIX = "cryptd:capacity:"
NONCE_TTL = 60


@dataclass
class NonceResult:
    processes: int
    concurrency: int
    seconds: float
    checks: int
    batches: int
    refused: int
    redis_cpu_s: float

    @property
    def per_second(self) -> float:
        return self.checks / self.seconds

    @property
    def us_per_check(self) -> float:
        return self.redis_cpu_s * 1e6 / max(1, self.checks)

    @property
    def per_redis_core(self) -> float:
        return 1e6 / self.us_per_check if self.us_per_check else 0.0


def _redis_cpu(url: str) -> float:
    with redis.Redis.from_url(url) as client:
        info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def _checker(url: str, concurrency: int, seconds: float) -> tuple[int, int, int]:
    store = RedisReplayStore(connect(url), prefix=PREFIX, max_skew=60)
    stop = time.monotonic() + seconds
    checks = refused = 0
    keyid = f"cap{os.getpid()}"

    async def loop() -> None:
        nonlocal checks, refused
        while time.monotonic() < stop:
            try:
                first = await store.remember(
                    keyid, secrets.token_hex(12), int(time.time()), NONCE_TTL
                )
            except StoreUnavailable:
                refused += 1
                continue
            if not first:
                raise AssertionError("a fresh nonce was called a replay")
            checks += 1

    try:
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        # The coalescer counts the batches it started: a store of the product's own.
        batches = store._coalescer.batches
    finally:
        await store.aclose()
    return checks, batches, refused


def _process(url: str, concurrency: int, seconds: float, out: Any) -> None:
    out.send(asyncio.run(_checker(url, concurrency, seconds)))
    out.close()


def measure_nonces(url: str, processes: int, concurrency: int, seconds: float) -> NonceResult:
    with redis.Redis.from_url(url) as client:
        client.eval(SEED_SCRIPT, 2, f"{PREFIX}epoch", f"{PREFIX}primary", 0)
    context = multiprocessing.get_context("fork")  # a checker needs nothing re-imported
    pipes, workers = [], []
    for _ in range(processes):
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(target=_process, args=(url, concurrency, seconds, send))
        pipes.append(receive)
        workers.append(worker)
    # What Redis spends with nothing to do (its timers, INFO here), taken off the run's CPU.
    idle_started, idle_before = time.monotonic(), _redis_cpu(url)
    time.sleep(1.0)
    idle_rate = (_redis_cpu(url) - idle_before) / (time.monotonic() - idle_started)
    cpu_before = _redis_cpu(url)
    started = time.monotonic()
    for worker in workers:
        worker.start()
    results = [pipe.recv() for pipe in pipes]
    elapsed = time.monotonic() - started
    cpu = _redis_cpu(url) - cpu_before - idle_rate * elapsed
    for worker in workers:
        worker.join(10)
    # Process start-up is inside ``elapsed`` but sends no check: the rate uses ``seconds``.
    return NonceResult(
        processes,
        concurrency,
        seconds,
        sum(r[0] for r in results),
        sum(r[1] for r in results),
        sum(r[2] for r in results),
        max(0.0, cpu),
    )


@dataclass
class WriteResult:
    writers: int
    keys: int
    seconds: float
    latencies: list[float]
    errors: int

    @property
    def per_second(self) -> float:
        return len(self.latencies) / self.seconds

    def quantile(self, q: float) -> float:
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else 0.0
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q * 100) - 1]


def measure_writes(url: str, writers: int, keys: int, seconds: float) -> WriteResult:
    from service.keys.admin import initialise
    from service.keys.manager import KeyManager
    from service.keys.masterkey import MasterKey
    from service.keys.pgstore import PostgresKeyStore

    master = MasterKey(secrets.token_bytes(32))
    setup = PostgresKeyStore(url)
    try:
        initialise(setup, master)
        manager = KeyManager(setup, master)
        manager.load()
        for index in range(keys):
            manager.create(f"k{index}", "aes256-gcm")
    finally:
        setup.close()
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    start = threading.Barrier(writers + 1)
    periods = itertools.count(1)  # next() on a count is atomic under the GIL

    def writer(index: int) -> None:
        nonlocal errors
        store = PostgresKeyStore(url)
        try:
            mine = KeyManager(store, master)
            mine.load()
            start.wait()
            while time.monotonic() < stop:
                name = f"k{secrets.randbelow(keys)}"
                # A period no write has set before (a write that changes nothing is no write).
                period = 3600 + next(periods)
                began = time.perf_counter()
                try:
                    mine.update(name, auto_rotate_period=period)
                except Exception:  # a refused write is counted, never hidden in a rate
                    with lock:
                        errors += 1
                    continue
                took = time.perf_counter() - began
                with lock:
                    latencies.append(took)
        finally:
            store.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join()
    return WriteResult(writers, keys, seconds, latencies, errors)


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with private_redis() as private:
        yield private


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.capacity", description=__doc__.split("\n")[0]
    )
    parser.add_argument("what", nargs="?", choices=("nonces", "keystore", "all"), default="all")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--processes", type=int, default=2, help="checking processes (nonces)")
    parser.add_argument(
        "--in-flight", default="1,8,64", help="checks in flight per process, one run each"
    )
    parser.add_argument("--redis-url", help="a Redis to measure (default: a private one)")
    parser.add_argument("--writers", type=int, default=4, help="writing threads (keystore)")
    parser.add_argument("--keys", type=int, default=100, help="keys in the keyring (keystore)")
    parser.add_argument("--keystore-url", default=DEFAULT_URL, help="PostgreSQL server")
    args = parser.parse_args(argv)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    if args.what in ("nonces", "all"):
        with _redis(args.redis_url) as url:
            runs = [
                measure_nonces(url, args.processes, int(count), args.duration)
                for count in args.in_flight.split(",")
            ]
        print()
        print(
            "| checking processes x in flight | checks/s | mean batch | Redis CPU us/check "
            "| checks/s per Redis core | refused |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for run in runs:
            print(
                f"| {run.processes} x {run.concurrency} | {run.per_second:,.0f} "
                f"| {run.checks / max(1, run.batches):.1f} | {run.us_per_check:.1f} "
                f"| {run.per_redis_core:,.0f} | {run.refused} |"
            )
    if args.what in ("keystore", "all"):
        with scratch_database(args.keystore_url) as conninfo:
            result = measure_writes(as_url(conninfo), args.writers, args.keys, args.duration)
        print()
        print("| writers | keys in the keyring | writes/s | P50 ms | P99 ms | errors |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {result.writers} | {result.keys} | {result.per_second:,.1f} "
            f"| {result.quantile(0.5) * 1e3:.1f} | {result.quantile(0.99) * 1e3:.1f} "
            f"| {result.errors} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
