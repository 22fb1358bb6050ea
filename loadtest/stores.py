"""Server workers and replay stores, side by side in one run: one worker against two, and two
workers sharing the host-local store (LMDB) against two sharing Redis.

    python -m loadtest.stores                  # 3 rounds of 10 s per configuration and scenario
    python -m loadtest.stores --quick          # 1 round of 3 s

All three servers (``cryptd serve --dev`` in private directories, signing and metrics on) run
at once and are measured in turn, the order rotating every round, with wrk on the same
machine. Redis is a private ``redis-server`` on a free port started for the run (no
persistence; its CPU is counted as the server's). The load generator shares the cores with the
servers: the question is what the second core and the shared store buy or cost, and pinning
the servers to one CPU would take the second core away. Prints a Markdown table of the
medians (ops/s, P50/P99, server CPU per request, Redis included) and writes the runs as JSON
to ``loadtest/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Final

import orjson

from loadtest.measure import Measurement
from loadtest.plan import Plan
from loadtest.progress import describe, log
from loadtest.report import summarize
from loadtest.sampling import measure, prepare, quietly
from loadtest.scenarios import BY_NAME
from loadtest.servers import free_port
from loadtest.session import RESULTS_DIR
from loadtest.targets import Cryptd

SCENARIOS: Final = ("aes-encrypt", "ecdsa-sign", "rsa-sign")
CONFIGURATIONS: Final = ("1 worker, host store", "2 workers, host store", "2 workers, Redis")


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of its own (never the shared one), replay epoch 0: nothing was lost."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
        import redis

        from service.auth.replay import KEY_PREFIX, SEED_SCRIPT

        with redis.Redis.from_url(url) as client:
            client.eval(SEED_SCRIPT, 2, f"{KEY_PREFIX}epoch", f"{KEY_PREFIX}primary", 0)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stores", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s")
    parser.add_argument("--duration", type=float, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, help="alternating rounds")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    scenarios = [BY_NAME[name] for name in args.scenarios.split(",")]
    plan = Plan.of_scenarios(
        tuple(s.name for s in scenarios),
        duration=args.duration or (3.0 if args.quick else 10.0),
        rounds=args.rounds or (1 if args.quick else 3),
        warmup=1.0,
        connections=args.connections,
    )
    work = Path(tempfile.mkdtemp(prefix="cryptd-stores-"))
    runs: dict[str, dict[str, list[Measurement]]] = {
        c: {s.name: [] for s in scenarios} for c in CONFIGURATIONS
    }
    with private_redis() as redis_url:
        servers = {
            CONFIGURATIONS[0]: Cryptd(work / "one", 1),
            CONFIGURATIONS[1]: Cryptd(work / "two-host", 2),
            CONFIGURATIONS[2]: Cryptd(work / "two-redis", 2, {"CRYPTD_REDIS_URL": redis_url}),
        }
        try:
            for server in servers.values():
                server.start()
                backend = server.get("/readyz").json()["checks"]["replay_store"]["backend"]
                log(f"{server.directory.name}: {server.workers} workers, {backend} store")
            prepared = {
                name: prepare([server], scenarios, work / f"bodies-{index}")
                for index, (name, server) in enumerate(servers.items())
            }
            for name, server in servers.items():
                for scenario in scenarios:
                    measure(server, scenario, prepared[name], plan, plan.warmup)
            for round_no in range(plan.rounds):
                shift = round_no % len(CONFIGURATIONS)
                order = CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]
                for scenario in scenarios:
                    for name in order:
                        server = servers[name]
                        bodies = prepared[name]
                        run = partial(measure, server, scenario, bodies, plan, plan.duration)
                        m = quietly(plan, run)
                        runs[name][scenario.name].append(m)
                        log(f"round {round_no + 1} {scenario.name} [{name}]: {describe(m)}")
        finally:
            for server in servers.values():
                server.stop()
    shutil.rmtree(work, ignore_errors=True)
    print(table(runs, [s.name for s in scenarios]))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS_DIR / f"stores-{stamp}.json"
    out.write_bytes(
        orjson.dumps(
            {c: {s: [asdict(m) for m in ms] for s, ms in v.items()} for c, v in runs.items()},
            option=orjson.OPT_INDENT_2,
        )
    )
    log(f"wrote {out}")
    return 0


def table(runs: dict[str, dict[str, list[Measurement]]], scenarios: list[str]) -> str:
    """Medians per (scenario, configuration), with the ratios the comparison is about."""
    lines = [
        "| scenario | configuration | ops/s | P50 / P99 ms | server CPU µs/request | ratio |",
        "|---|---|--:|--:|--:|---|",
    ]
    for scenario in scenarios:
        summaries = {c: summarize(runs[c][scenario], 2) for c in CONFIGURATIONS}
        one, host, shared = (summaries[c].ops for c in CONFIGURATIONS)
        ratios = {
            CONFIGURATIONS[0]: "",
            CONFIGURATIONS[1]: f"{host / one:.2f}x one worker",
            CONFIGURATIONS[2]: f"{shared / host:.2f}x host store",
        }
        for name, summary in summaries.items():
            cpu = summary.server_cpu_per_request_us
            lines.append(
                f"| {scenario} | {name} | {summary.ops:,.0f} | "
                f"{summary.p50_ms:.2f} / {summary.p99_ms:.2f} | "
                f"{'' if cpu is None else f'{cpu:.0f}'} | {ratios[name]} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
