"""Benchmark the executors with real signatures: which kind, how many workers, what batch size.

    .venv/bin/python loadtest/bench_executors.py [--seconds 0.4] [--rounds 3]
        [--sections executors,ipc,gil] [--json out.json]

For RSA-2048 PSS, ECDSA-P256 and Ed25519 signing (pyca/cryptography keys parsed once per worker by
the initializer, as cryptd does) through inline / thread / process executors, with 1 and 100
items per task and 64 concurrent run() calls on uvloop: operations per second, tasks per second and
task latency. A no-op task measures the per-task overhead of each executor, an echo task (1 KiB
items there and back) the cost of moving a batch across. Two more sections
check the facts the design rests on: raw threads (does pyca release the GIL?) and the way results
come back from a worker (the loop's own reader vs a reader thread per worker).

Figures are for comparing rows of one run on one machine; absolutes move with the load. Every
comparison alternates its candidates round by round and keeps the median, and the GIL check has
two controls (one that releases the GIL, one that holds it) that show what the machine allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cryptography
import uvloop
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.pool import Executor, ExecutorKind, make_executor
from service.pool.channel import FrameProtocol
from service.pool.wire import Kind, read_frame, write_frame

CONCURRENCY = 64
MESSAGE = b"m" * 1024
ALGORITHMS = ("rsa2048-pss", "ecdsa-p256", "ed25519")

# -- what runs in the workers -----------------------------------------------------------------

_KEYS: dict[str, Any] = {}
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def load_keys(pems: dict[str, bytes]) -> None:
    """Initializer: parse each key once per worker process (RSA parsing costs ~30 ms)."""
    for name, pem in pems.items():
        _KEYS[name] = serialization.load_pem_private_key(pem, password=None)


def sign_batch(algorithm: str, messages: list[bytes]) -> list[bytes]:
    key = _KEYS[algorithm]
    if algorithm == "rsa2048-pss":
        return [key.sign(m, _PSS, hashes.SHA256()) for m in messages]
    if algorithm == "ecdsa-p256":
        return [key.sign(m, ec.ECDSA(hashes.SHA256())) for m in messages]
    return [key.sign(m) for m in messages]


def noop(messages: list[bytes]) -> int:
    return len(messages)


def echo(messages: list[bytes]) -> list[bytes]:
    return messages


def make_pems() -> dict[str, bytes]:
    keys: dict[str, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey]
    keys = {
        "rsa2048-pss": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ecdsa-p256": ec.generate_private_key(ec.SECP256R1()),
        "ed25519": ed25519.Ed25519PrivateKey.generate(),
    }
    return {
        name: key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        for name, key in keys.items()
    }


# -- executor runs ----------------------------------------------------------------------------


@dataclass
class Row:
    executor: str
    operation: str
    batch: int
    ops_per_s: float
    tasks_per_s: float
    p50_ms: float
    p99_ms: float


async def drive(
    run: Callable[[], Awaitable[object]], seconds: float, concurrency: int
) -> tuple[float, list[float]]:
    """``concurrency`` callers each awaiting run() back to back for ``seconds``; counts the
    tasks that completed inside the window (the queue stays full throughout, so this is the
    steady-state rate). Callers still waiting at the end are cancelled, which drops their
    queued tasks; the few already running finish during the next warm-up. Returns tasks per
    second, timed between the first and last completion (precise even when few long tasks fit
    in the window), and the latencies."""
    latencies: list[float] = []
    finished: list[float] = []
    stop = time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await run()
            t1 = time.perf_counter()
            if t1 <= stop:
                latencies.append(t1 - t0)
                finished.append(t1)

    callers = [asyncio.ensure_future(caller()) for _ in range(concurrency)]
    _, late = await asyncio.wait(callers, timeout=max(0.0, stop - time.perf_counter()))
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    if len(finished) >= 3 and finished[-1] > finished[0]:
        return (len(finished) - 1) / (finished[-1] - finished[0]), latencies
    return len(finished) / seconds, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


CONFIGS: list[tuple[str, ExecutorKind, int]] = [
    ("inline", "inline", 1),
    ("thread-1", "thread", 1),
    ("thread-2", "thread", 2),
    ("process-2", "process", 2),
]


async def measure_cell(executor: Executor, operation: str, size: int, seconds: float) -> Row:
    # Distinct objects: pickle would send a repeated object once and back-reference it.
    items = [i.to_bytes(4, "big") + MESSAGE[4:] for i in range(size)]
    one: Callable[[], Awaitable[object]]
    if operation == "noop":
        one = functools.partial(executor.run, noop, items)
    elif operation == "echo":
        one = functools.partial(executor.run, echo, items)
    else:
        one = functools.partial(executor.run, sign_batch, operation, items)
    await drive(one, 0.05, CONCURRENCY)  # warm-up: fill the queue, touch the caches
    tasks_per_s, latencies = await drive(one, seconds, CONCURRENCY)
    return Row(
        executor=executor.kind,
        operation=operation,
        batch=size,
        ops_per_s=tasks_per_s * size,
        tasks_per_s=tasks_per_s,
        p50_ms=percentile(latencies, 0.5) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3,
    )


async def measure_overhead(executor: Executor, seconds: float) -> float:
    """Round trip of a task that does nothing, one caller: the executor's own cost, in µs."""
    batch = [MESSAGE]
    await executor.run(noop, batch)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        await executor.run(noop, batch)
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def median_row(samples: list[Row], label: str) -> Row:
    best = sorted(samples, key=lambda r: r.ops_per_s)[len(samples) // 2]
    return Row(
        label,
        best.operation,
        best.batch,
        best.ops_per_s,
        best.tasks_per_s,
        best.p50_ms,
        best.p99_ms,
    )


async def bench_executors(
    pems: dict[str, bytes], seconds: float, rounds: int
) -> tuple[list[Row], dict[str, float]]:
    """Every executor runs side by side; each cell alternates them round by round and keeps
    the median, so a burst of load from elsewhere hits all of them alike."""
    executors: dict[str, Executor] = {}
    for label, kind, workers in CONFIGS:
        executors[label] = make_executor(
            kind,
            workers=workers,
            max_pending=4 * CONCURRENCY,
            deadline=60.0,
            initializer=load_keys,
            initargs=(pems,),
        )
        await executors[label].start()
    rows: list[Row] = []
    overheads: dict[str, list[float]] = {label: [] for label in executors}
    try:
        labels = list(executors)
        for r in range(rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                overheads[label].append(await measure_overhead(executors[label], seconds / 2))
        for operation in ("noop", "echo", *ALGORITHMS):
            for size in (1, 100):
                samples: dict[str, list[Row]] = {label: [] for label in labels}
                for r in range(rounds):
                    for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                        row = await measure_cell(executors[label], operation, size, seconds)
                        samples[label].append(row)
                rows += [median_row(samples[label], label) for label in labels]
    finally:
        for executor in executors.values():
            await executor.close()
    rows.sort(key=lambda row: labels.index(row.executor))
    return rows, {label: statistics.median(v) for label, v in overheads.items()}


# -- does pyca release the GIL? raw threads, no executor ------------------------------------


def _spin(algorithm: str, stop: float, counts: list[int], index: int) -> None:
    work = CONTROLS.get(algorithm, sign_batch)
    while time.perf_counter() < stop:
        counts[index] += len(work(algorithm, [MESSAGE] * 10))


def sha256_1mib(_: str, __: list[bytes]) -> list[bytes]:
    """Control that releases the GIL (hashlib does for large inputs): the machine's parallelism."""
    return [hashlib.sha256(_MIB).digest()]


def python_loop(_: str, __: list[bytes]) -> list[bytes]:
    """Control that holds the GIL: what no speed-up looks like."""
    total = 0
    for i in range(20_000):
        total += i * i
    return [total.to_bytes(16, "big")]


_MIB = b"\0" * (1 << 20)
CONTROLS: dict[str, Callable[[str, list[bytes]], list[bytes]]] = {
    "control: sha256 1 MiB (releases GIL)": sha256_1mib,
    "control: python loop (holds GIL)": python_loop,
}


def spin_threads(algorithm: str, threads: int, seconds: float) -> tuple[float, float]:
    """Operations per second and process CPU seconds per wall second."""
    counts = [0] * threads
    stop = time.perf_counter() + seconds
    pool = [
        threading.Thread(target=_spin, args=(algorithm, stop, counts, i)) for i in range(threads)
    ]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return sum(counts) / seconds, cpu / wall


PROBE_SWITCH_INTERVAL = 0.05
PROBE_SAMPLES = 9


def gil_probe_wait(algorithm: str) -> float:
    """Median time (s) the main thread waits to get the GIL back while one thread runs
    ``algorithm`` back to back. Code that releases the GIL lets it in within microseconds; code
    that holds it lets it in only when forced, after the switch interval (50 ms here). Unlike a
    speed-up, this does not need a free core, so it holds on a loaded machine."""
    stop = threading.Event()

    def busy() -> None:
        work = CONTROLS.get(algorithm, sign_batch)
        while not stop.is_set():
            work(algorithm, [MESSAGE])

    previous = sys.getswitchinterval()
    sys.setswitchinterval(PROBE_SWITCH_INTERVAL)
    thread = threading.Thread(target=busy)
    thread.start()
    waits = []
    try:
        time.sleep(0.02)
        for _ in range(PROBE_SAMPLES):
            t0 = time.perf_counter()
            time.sleep(0)  # drops the GIL and takes it back
            waits.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(previous)
    return statistics.median(waits)


def raw_threads(pems: dict[str, bytes], seconds: float, rounds: int) -> list[dict[str, Any]]:
    """One thread vs two, no executor. A GIL-bound operation gets no speed-up and its process
    uses ~1 CPU second per wall second; one that releases the GIL approaches 2x and 2 CPU s/s
    (when the machine has two free cores: the sha256 control shows what this machine gave)."""
    load_keys(pems)
    out = []
    for algorithm in (*ALGORITHMS, *CONTROLS):
        one, two, cpu = [], [], []
        for _ in range(rounds):
            one.append(spin_threads(algorithm, 1, seconds / 2)[0])
            rate, cpu_per_wall = spin_threads(algorithm, 2, seconds / 2)
            two.append(rate)
            cpu.append(cpu_per_wall)
        out.append(
            {
                "operation": algorithm,
                "one_thread_ops_per_s": statistics.median(one),
                "two_threads_ops_per_s": statistics.median(two),
                "speedup": statistics.median(b / a for a, b in zip(one, two, strict=True)),
                "two_threads_cpu_per_wall": statistics.median(cpu),
                "gil_wait_ms": gil_probe_wait(algorithm) * 1e3,
            }
        )
    return out


# -- how results come back: loop reader vs reader thread -----------------------------------


def echo_worker(sock: socket.socket) -> None:
    with sock, sock.makefile("rb") as reader:
        while (frame := read_frame(reader)) is not None:
            write_frame(sock, Kind.RESULT, frame[1], frame[2])


async def ipc_round_trips(mode: str, children: int, seconds: float) -> float:
    import multiprocessing

    loop = asyncio.get_running_loop()
    ctx = multiprocessing.get_context("spawn")
    procs, callers, cleanups = [], [], []
    payload = b"x" * 200
    for _ in range(children):
        parent, child = socket.socketpair()
        proc = ctx.Process(target=echo_worker, args=(child,), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        waiter: dict[str, asyncio.Future[None]] = {}
        if mode == "loop-reader":

            def on_frame(kind: Kind, msg_id: int, body: memoryview, w: Any = waiter) -> None:
                w.pop("f").set_result(None)

            proto = FrameProtocol(on_frame, lambda: None)
            await loop.create_unix_connection(lambda p=proto: p, sock=parent)  # type: ignore[misc]

            send: Callable[[], None] = functools.partial(proto.send, Kind.TASK, 1, payload)

            cleanups.append(proto.close)
        else:
            reader = parent.makefile("rb")

            def pump(r: Any = reader, w: Any = waiter) -> None:
                while read_frame(r) is not None:
                    loop.call_soon_threadsafe(lambda: w.pop("f").set_result(None))

            thread = threading.Thread(target=pump, daemon=True)
            thread.start()

            send = functools.partial(write_frame, parent, Kind.TASK, 1, payload)

            def close(s: socket.socket = parent, r: Any = reader, t: Any = thread) -> None:
                s.shutdown(socket.SHUT_RDWR)
                t.join()
                r.close()
                s.close()

            cleanups.append(close)

        async def caller(send: Callable[[], None] = send, w: Any = waiter) -> int:
            n = 0
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop:
                w["f"] = loop.create_future()
                send()
                await w["f"]
                n += 1
            return n

        callers.append(caller)
    await asyncio.sleep(0.3)  # let the children boot
    counts = await asyncio.gather(*(c() for c in callers))
    for cleanup in cleanups:
        cleanup()
    await asyncio.sleep(0.05)
    for proc in procs:
        proc.join(5)
        proc.close()
    return sum(counts) / seconds


# -- report ---------------------------------------------------------------------------------


def print_table(
    rows: list[Row],
    overheads: dict[str, float],
    gil: list[dict[str, Any]],
    ipc: dict[str, float],
) -> None:
    print(f"\nexecutor throughput, {CONCURRENCY} concurrent callers, uvloop")
    print(
        f"{'executor':<10} {'operation':<12} {'batch':>5} {'ops/s':>10} {'tasks/s':>9} "
        f"{'p50 ms':>8} {'p99 ms':>8}"
    )
    for r in rows:
        print(
            f"{r.executor:<10} {r.operation:<12} {r.batch:>5} {r.ops_per_s:>10,.0f} "
            f"{r.tasks_per_s:>9,.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f}"
        )
    print("\nper-task overhead (no-op task, one caller, round trip)")
    for label, us in overheads.items():
        print(f"  {label:<10} {us:8.1f} us")
    print("\nraw threads, no executor (GIL check)")
    for g in gil:
        print(
            f"  {g['operation']:<38} 1T {g['one_thread_ops_per_s']:>8,.0f}/s  "
            f"2T {g['two_threads_ops_per_s']:>8,.0f}/s  x{g['speedup']:.2f}  "
            f"2T cpu/wall {g['two_threads_cpu_per_wall']:.2f}  GIL wait {g['gil_wait_ms']:6.2f} ms"
        )
    print("\nresult delivery from a worker process (echo round trips/s, uvloop)")
    for label, rate in ipc.items():
        print(f"  {label:<26} {rate:>10,.0f}/s")


async def main(seconds: float, rounds: int, sections: set[str]) -> dict[str, Any]:
    load_before = os.getloadavg()
    pems = make_pems()
    rows: list[Row] = []
    overheads: dict[str, float] = {}
    if "executors" in sections:
        rows, overheads = await bench_executors(pems, seconds, rounds)
    ipc: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    for _ in range(rounds if "ipc" in sections else 0):
        for mode in ("loop-reader", "reader-thread"):
            for children in (1, 2):
                rate = await ipc_round_trips(mode, children, seconds / 2)
                samples.setdefault(f"{mode} x{children} worker", []).append(rate)
    ipc = {label: statistics.median(v) for label, v in samples.items()}
    gil = raw_threads(pems, seconds, rounds) if "gil" in sections else []
    print_table(rows, overheads, gil, ipc)
    print(f"\nload average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "cryptography": cryptography.__version__,
            "loop": "uvloop " + importlib.metadata.version("uvloop"),
            "seconds_per_cell": seconds,
            "rounds": rounds,
            "concurrency": CONCURRENCY,
            "message_bytes": len(MESSAGE),
            "load_average_before": load_before[0],
        },
        "executors": [asdict(r) for r in rows],
        "per_task_overhead_us": overheads,
        "raw_threads": gil,
        "ipc_round_trips_per_s": ipc,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.4, help="measurement time per cell")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median kept)")
    parser.add_argument(
        "--sections",
        default="executors,ipc,gil",
        help="comma-separated subset of: executors, ipc, gil",
    )
    parser.add_argument("--json", type=Path, help="also write the JSON report to this file")
    args = parser.parse_args()
    report = uvloop.run(main(args.seconds, args.rounds, set(args.sections.split(","))))
    text = json.dumps(report, indent=2)
    print("\n" + text)
    if args.json:
        args.json.write_text(text + "\n")
