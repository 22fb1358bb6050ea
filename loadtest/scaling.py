"""Server CPU per request with one and with two workers under the same offered load:
``python -m loadtest.scaling``.

Throughput cannot tell whether a second worker costs anything on a 2-core machine (the load
generator needs a core too), so this compares what the server spends per request: the same
open-loop rate (``loadtest/openloop.py``, every request signed when sent) against ``cryptd
serve --dev`` with 1 and with 2 workers, the CPU of the server's whole process tree read from
/proc (utime + stime; Redis's too when it holds the replay state). What a second worker may add
is switched off one part at a time, each configuration measured with both worker counts in
the same round:

- ``default``: the host replay store (one LMDB shared by the workers, a write transaction per
  loop iteration), metrics (prometheus-client's files with several workers, in memory with
  one), key usage flushed every 2 s by every worker;
- ``metrics-off``: ``CRYPTD_METRICS=false``;
- ``replay-redis``: the replay store in Redis (a round trip per request; Redis's CPU counted);
- ``usage-rare``: ``CRYPTD_USAGE_FLUSH_INTERVAL=3600``.

The CPU the server spends idle (timers of every worker) is measured before each load and
reported apart, as is how the requests spread over the workers (each worker's share of the
CPU). The goal: with 2 workers, CPU per request within 10 % of one worker's.

Two loads. The offered rate (the default) asks what a second worker costs at a given traffic:
below saturation each wake-up of a worker finds fewer requests waiting when two share them, so
a cost paid per wake-up (the epoll round, the replay store's commit, waking an idle CPU) is
shared by fewer requests. ``--saturated`` asks what it costs at full load: wrk's closed loop
(16 connections) keeps every worker busy, and CPU per request is the server CPUs' time over the
requests answered. Where they run: anywhere by default, since on two CPUs pinning would put
both workers on one core (what that costs is oversubscription, not one more core); with
``--server-cpus`` (and ``--client-cpus``) the workers and the load generator are pinned apart,
e.g. ``--saturated --client-cpus 0-1 --server-cpus 2-3`` on four CPUs. The printed table
is written to ``docs/results/DATE-scaling.md`` (``--output`` elsewhere). The per-request
instruction counts of the parts (the honest measure on a shared machine) come from
``python -m loadtest.instructions --variant ...``; docs/PERFORMANCE.md puts both together.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import orjson

from loadtest import records
from loadtest.machine import interpreter
from loadtest.measure import Measurement
from loadtest.openloop import http_request, run_open_loop
from loadtest.plan import Plan, Topology, make_topology
from loadtest.procstat import process_cpu_seconds, tree_cpu_seconds
from loadtest.sampling import measure, prepare
from loadtest.scenarios import BY_NAME
from loadtest.servers import redis_url
from loadtest.targets import Cryptd, prepare_body
from service.auth.signature import sign_request

GOAL: Final = 0.10  # two workers' CPU per request at most 10 % above one worker's
# Its own database number, so that nothing else on a shared Redis is touched.
REDIS: Final = "redis://127.0.0.1:6379/11"


def configurations(redis: str | None) -> dict[str, dict[str, str]]:
    found = {
        "default": {},
        "metrics-off": {"CRYPTD_METRICS": "false"},
        "usage-rare": {"CRYPTD_USAGE_FLUSH_INTERVAL": "3600"},
    }
    if redis:
        found["replay-redis"] = {"CRYPTD_REDIS_URL": redis}
    return found


@dataclass
class Row:
    configuration: str
    workers: int
    cpu_us: list[float] = field(default_factory=list)  # server CPU per answered request
    idle_cpu: list[float] = field(default_factory=list)  # server CPU seconds per second idle
    rps: list[float] = field(default_factory=list)
    errors: int = 0
    busiest_share: list[float] = field(default_factory=list)  # busiest worker's CPU share

    @property
    def median_us(self) -> float:
        return statistics.median(self.cpu_us)

    @property
    def busy_us(self) -> float:
        """CPU per request without what the server spends idle over the same time."""
        rate = statistics.median(self.rps)
        return self.median_us - statistics.median(self.idle_cpu) / rate * 1e6


def _workers(server: Cryptd) -> list[int]:
    """The server workers' pids (children of the supervisor)."""
    return [pid for pid in process_cpu_seconds(server.pid) if pid != server.pid]


@dataclass(frozen=True)
class Load:
    """What each measurement offers: ``rate`` requests/s open loop, or (``rate`` 0) wrk's
    closed loop at full load (``plan``: its connections, threads and topology)."""

    rate: float
    duration: float
    idle: float
    plan: Plan

    @property
    def saturated(self) -> bool:
        return self.rate <= 0


def _measure_one(server: Cryptd, row: Row, load: Load, work: Path) -> None:
    scenario = BY_NAME["aes-encrypt"]
    duration = load.duration
    if load.saturated:
        prepared = prepare([server], [scenario], work / "bodies")

        def run(seconds: float) -> Measurement:
            return measure(server, scenario, prepared, load.plan, seconds)
    else:
        body = orjson.dumps(prepare_body(server, scenario.cryptd))
        path = scenario.cryptd.path
        host = server.url.removeprefix("http://")

        def request() -> bytes:
            headers = sign_request("POST", path, "", body, server.client_id, server.secret)
            return http_request(host, path, headers, body)

        def run(seconds: float) -> Measurement:
            return run_open_loop(
                server.url, request, rate=load.rate, duration=seconds, server_pid=server.pids
            )

    run(min(2.0, duration))  # warm-up
    before = tree_cpu_seconds(server.pids)
    time.sleep(load.idle)
    row.idle_cpu.append((tree_cpu_seconds(server.pids) - before) / load.idle)
    workers = _workers(server)
    start = process_cpu_seconds(server.pid)
    m = run(duration)
    end = process_cpu_seconds(server.pid)
    spent = [end.get(pid, 0.0) - start.get(pid, 0.0) for pid in workers]
    if m.server_cpu_s is None or m.requests == 0:
        raise RuntimeError("no server CPU or no answers measured")
    row.cpu_us.append(m.server_cpu_s / m.requests * 1e6)
    row.rps.append(m.rps)
    row.errors += m.errors
    if sum(spent) > 0:
        row.busiest_share.append(max(spent) / sum(spent))


def run(workdir: Path, load: Load, rounds: int, redis: str | None) -> list[Row]:
    rows: dict[tuple[str, int], Row] = {}
    cpus = load.plan.topology.server_cpus
    for round_no in range(rounds):
        for name, env in configurations(redis).items():
            counts = (1, 2) if round_no % 2 == 0 else (2, 1)  # alternate: drift hits both
            for workers in counts:
                row = rows.setdefault((name, workers), Row(name, workers))
                server = Cryptd(workdir / "state", workers=workers, env=env, cpus=cpus)
                server.start()
                try:
                    _measure_one(server, row, load, workdir)
                finally:
                    server.stop()
                print(
                    f"round {round_no + 1}/{rounds} {name} workers={workers}: "
                    f"{row.cpu_us[-1]:.1f} us CPU/request at {row.rps[-1]:,.0f} req/s",
                    file=sys.stderr,
                    flush=True,
                )
    return list(rows.values())


def describe_load(load: Load) -> str:
    what = (
        f"wrk's closed loop at full load ({load.plan.connections} connections)"
        if load.saturated
        else f"offered {load.rate:,.0f} req/s open loop"
    )
    return f"{what}, AES-256-GCM encrypt 1 KiB, signed; {load.plan.topology.summary()}"


def table(rows: Sequence[Row], load: str) -> str:
    by = {(r.configuration, r.workers): r for r in rows}
    lines = [
        f"Load: {load}; server CPU from /proc.",
        "",
        "| configuration | workers | CPU us/request | without idle | idle CPU (cores) "
        "| busiest worker's share | 2 workers against 1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        one = by.get((row.configuration, 1))
        ratio = f"{row.busy_us / one.busy_us - 1:+.1%}" if row.workers == 2 and one else ""
        share = f"{statistics.median(row.busiest_share):.0%}" if row.busiest_share else ""
        lines.append(
            f"| {row.configuration} | {row.workers} | {row.median_us:.1f} | {row.busy_us:.1f} "
            f"| {statistics.median(row.idle_cpu):.3f} | {share} | {ratio} |"
        )
    errors = sum(r.errors for r in rows)
    lines += ["", f"Errors: {errors}. Goal: 2 workers within +{GOAL:.0%} of one (without idle)."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scaling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="offered req/s (1000)")
    parser.add_argument(
        "--saturated",
        action="store_true",
        help="wrk's closed loop at full load instead of an offered rate",
    )
    parser.add_argument("--connections", type=int, default=16, help="with --saturated (16)")
    parser.add_argument(
        "--server-cpus", help="pin the server's workers to these CPUs, e.g. 2-3 (default: anywhere)"
    )
    parser.add_argument(
        "--client-cpus", help="with --server-cpus: the load generator's (default: the others)"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load (10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle measured (3)")
    parser.add_argument("--redis", default=REDIS, help="'none' to skip replay-redis")
    parser.add_argument("--output", type=Path, help="default: docs/results/DATE-scaling.md")
    args = parser.parse_args(argv)
    redis = redis_url(args.redis)
    args.shared_cores = not args.server_cpus
    topology = make_topology(args)
    if topology.pinned:
        os.sched_setaffinity(0, topology.client)  # the open-loop client and wrk, our child
    load = Load(
        0.0 if args.saturated else args.rate, args.duration, args.idle, _plan(args, topology)
    )
    load_before = Path("/proc/loadavg").read_text().split()[0]
    with tempfile.TemporaryDirectory(prefix="cryptd-scaling-") as scratch:
        rows = run(Path(scratch), load, args.rounds, redis)
    text = table(rows, describe_load(load))
    print(text)
    now = dt.datetime.now(dt.UTC)
    command = " ".join(["python -m loadtest.scaling", *(argv or sys.argv[1:])])
    document = (
        f"# CPU per request with 1 and 2 workers ({now:%Y-%m-%d %H:%M} UTC)\n\n"
        f"`{command}`; {interpreter()}; load average before the run "
        f"{load_before}.\n\n{text}\n"
    )
    if args.output:
        out = args.output
        out.write_text(document)
    else:
        out = records.keep("scaling", document, now)
    print(f"written {out}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace, topology: Topology) -> Plan:
    """What wrk needs to know with --saturated."""
    return Plan.of_scenarios(
        ("aes-encrypt",),
        duration=args.duration,
        rounds=args.rounds,
        warmup=0.0,
        connections=args.connections,
        topology=topology,
    )


if __name__ == "__main__":
    sys.exit(main())
