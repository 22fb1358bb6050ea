"""The PostgreSQL key store under load: two replicas, and file against PostgreSQL.

    python -m loadtest.keystore propagation [--requests 1000] [--concurrency 8]
    python -m loadtest.keystore backends [--duration 10] [--rounds 3] [--scenarios ...]

``propagation``: two replicas (``cryptd serve --dev``, two workers each) share a fresh database
on ``--url``'s server. ``--requests`` mixed requests (create, rotate, encrypt, decrypt) go to
either replica at random from ``--concurrency`` threads; an encrypt or decrypt names a key some
earlier create returned 201 for (a decrypt takes a token made earlier, on either replica,
possibly under a version just rotated). Checked: no 404 for a key that exists, no key or
version lost (every rotation got its own number, both replicas describe every key with
versions 1..N at the end). Propagation: every worker logs when it serves a new generation;
for each change, the time from the commit (the writer's log line) until each other worker
serves that generation or a later one — its P50/P99/max, through notifications and the
periodic check alone (the requests that made a worker look in the store are counted apart:
they never answered 404 either). Exits 1 when a check fails.

``backends``: the same crypto scenarios with wrk (the runner's measure(): signed requests,
fresh nonces) against one cryptd on the keyring file and one on PostgreSQL, one worker each,
alternating round by round: keys are served from memory, so the ratio should be 1.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg

from loadtest.measure import Measurement
from loadtest.plan import Plan
from loadtest.progress import log
from loadtest.report import summarize
from loadtest.sampling import Prepared, measure, quietly
from loadtest.scenarios import BY_NAME
from loadtest.servers import redis_url
from loadtest.targets import Cryptd, check_response, prepare_body
from service.auth.signature import sign_request

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
BACKEND_SCENARIOS = ("aes-encrypt", "aes-decrypt", "rsa-sign", "sm2-sign", "aes-batch")


@contextlib.contextmanager
def scratch_database(url: str) -> Iterator[str]:
    """A database of this run's own on ``url``'s server, dropped afterwards."""
    name = f"cryptd_loadtest_{secrets.token_hex(5)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(url, dbname=name)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def as_url(conninfo: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    user = f"{params['user']}@" if params.get("user") else ""
    host, port = params.get("host", "127.0.0.1"), params.get("port", "5432")
    return f"postgresql://{user}{host}:{port}/{params['dbname']}"


def start_replicas(
    directory: Path, keystore_url: str, workers: int, env: dict[str, str]
) -> list[Cryptd]:
    """Two replicas with one master key and one clients file (the second gets a copy of the
    first's development state) on one key store."""
    settings = {"CRYPTD_KEYSTORE_URL": keystore_url, "CRYPTD_AUDIT_LOG": "off", **env}
    first = Cryptd(directory / "replica-a", workers, settings, name="replica-a")
    first.start()
    state = directory / "replica-b" / "dev"
    state.mkdir(parents=True)
    for name in ("master.key", "clients.json"):
        shutil.copy2(directory / "replica-a" / "dev" / name, state / name)
    second = Cryptd(directory / "replica-b", workers, settings, name="replica-b")
    second.start()
    return [first, second]


# --------------------------------------------------------------------------------------------
# Propagation


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    missing_existing: list[str] = field(default_factory=list)
    rotations: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    created: list[str] = field(default_factory=list)
    tokens: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Signed:
    """One keep-alive connection to one replica, every request signed."""

    def __init__(self, target: Cryptd) -> None:
        self.target = target
        self.http = httpx.Client(base_url=target.url, timeout=30)

    def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        content = b"" if body is None else orjson.dumps(body)
        headers = sign_request(method, path, "", content, self.target.client_id, self.target.secret)
        return self.http.request(method, path, content=content, headers=headers)

    def close(self) -> None:
        self.http.close()


def run_mixed(targets: Sequence[Cryptd], requests: int, concurrency: int, seed: int) -> Tally:
    tally = Tally()
    # A few keys to start from, so the first encryptions have something to use.
    opener = Signed(targets[0])
    for index in range(4):
        name = f"seed-{index}"
        if opener.call("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"}).status_code == 201:
            tally.created.append(name)
    opener.close()
    counter = iter(range(requests))
    counter_lock = threading.Lock()

    def worker(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        clients = [Signed(t) for t in targets]
        try:
            while True:
                with counter_lock:
                    index = next(counter, None)
                if index is None:
                    return
                one(rng, rng.choice(clients), index)
        finally:
            for client in clients:
                client.close()

    def one(rng: random.Random, client: Signed, index: int) -> None:
        roll = rng.random()
        with tally.lock:
            existing = list(tally.created)
            tokens = list(tally.tokens)
        if roll < 0.1:
            name = f"k{index:05d}"
            response = client.call("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"})
            record(response, "create")
            if response.status_code == 201:
                with tally.lock:
                    tally.created.append(name)
        elif roll < 0.2:
            name = rng.choice(existing)
            response = client.call("POST", f"/v1/keys/{name}/rotate")
            record(response, "rotate", name)
            if response.status_code == 200:
                with tally.lock:
                    tally.rotations[name].append(response.json()["latest_version"])
        elif roll < 0.6 or not tokens:
            name = rng.choice(existing)
            plaintext = base64.b64encode(f"{index}".encode()).decode()
            response = client.call("POST", f"/v1/encrypt/{name}", {"plaintext": plaintext})
            record(response, "encrypt", name)
            if response.status_code == 200:
                with tally.lock:
                    tally.tokens.append((name, response.json()["ciphertext"]))
        else:
            name, token = rng.choice(tokens)
            response = client.call("POST", f"/v1/decrypt/{name}", {"ciphertext": token})
            record(response, "decrypt", name)

    def record(response: httpx.Response, operation: str, name: str | None = None) -> None:
        with tally.lock:
            tally.statuses[f"{operation} {response.status_code}"] += 1
            if response.status_code == 404 and name is not None:
                tally.missing_existing.append(f"{operation} {name}")
            elif response.status_code >= 400 and not (
                operation == "create" and response.status_code == 409
            ):
                tally.failures.append(f"{operation} {name}: {response.status_code}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally


def check_nothing_lost(targets: Sequence[Cryptd], tally: Tally) -> list[str]:
    problems = []
    for name, versions in tally.rotations.items():
        if len(set(versions)) != len(versions):
            problems.append(f"{name}: two rotations got one version {sorted(versions)}")
    for target in targets:
        client = Signed(target)
        try:
            for name in tally.created:
                response = client.call("GET", f"/v1/keys/{name}")
                if response.status_code != 200:
                    problems.append(f"{target.name}: {name} answers {response.status_code}")
                    continue
                numbers = [v["version"] for v in response.json()["versions"]]
                expected = list(range(1, len(tally.rotations.get(name, [])) + 2))
                if numbers != expected:
                    problems.append(f"{target.name}: {name} has versions {numbers}")
        finally:
            client.close()
    return problems


@dataclass(frozen=True)
class Line:
    at: float
    pid: int
    generation: int
    message: str


def keyring_lines(logs: Sequence[Path]) -> list[Line]:
    lines = []
    for path in logs:
        for raw in path.read_bytes().splitlines():
            try:
                entry = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if entry.get("msg") in ("keyring loaded", "keyring changed") and "pid" in entry:
                at = datetime.strptime(entry["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()
                lines.append(Line(at, entry["pid"], entry["generation"], entry["msg"]))
    return sorted(lines, key=lambda line: line.at)


def propagation_delays(lines: Sequence[Line]) -> list[float]:
    """For every change: seconds from its commit until each other worker serves it (or a
    later generation)."""
    commits = {line.generation: line for line in lines if line.message == "keyring changed"}
    workers = {line.pid for line in lines}
    first_at: dict[int, list[Line]] = defaultdict(list)
    for line in lines:
        first_at[line.pid].append(line)
    delays = []
    for generation, commit in commits.items():
        for pid in workers - {commit.pid}:
            later = [ln.at for ln in first_at[pid] if ln.generation >= generation]
            if later:
                delays.append(max(0.0, min(later) - commit.at))
    return delays


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def propagation(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="cryptd-keystore-load-"))
    redis = redis_url("auto")
    env = {"CRYPTD_LOG_LEVEL": "info", **({"CRYPTD_REDIS_URL": redis} if redis else {})}
    with scratch_database(args.url) as conninfo, contextlib.ExitStack() as stack:
        targets = start_replicas(workdir, as_url(conninfo), args.workers, env)
        for target in targets:
            stack.callback(target.stop)
        log(f"replicas at {', '.join(t.url for t in targets)} on {as_url(conninfo)}")
        started = time.monotonic()
        tally = run_mixed(targets, args.requests, args.concurrency, args.seed)
        seconds = time.monotonic() - started
        time.sleep(2.0)  # the last changes reach every worker; their lines reach the log
        lost = check_nothing_lost(targets, tally)
        delays = propagation_delays(keyring_lines([t.directory / "server.log" for t in targets]))
    result = {
        "requests": sum(tally.statuses.values()),
        "seconds": round(seconds, 2),
        "statuses": dict(sorted(tally.statuses.items())),
        "keys": len(tally.created),
        "rotations": sum(len(v) for v in tally.rotations.values()),
        "404_on_existing_key": len(tally.missing_existing),
        "lost": lost,
        "other_failures": tally.failures[:20],
        "propagation_samples": len(delays),
        "propagation_p50_ms": round(statistics.median(delays) * 1e3, 1) if delays else None,
        "propagation_p99_ms": round(percentile(delays, 0.99) * 1e3, 1) if delays else None,
        "propagation_max_ms": round(max(delays) * 1e3, 1) if delays else None,
    }
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    shutil.rmtree(workdir, ignore_errors=True)
    ok = (
        not tally.missing_existing
        and not lost
        and not tally.failures
        and delays
        and percentile(delays, 0.99) < 1.0
    )
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------
# File against PostgreSQL


def backends(args: argparse.Namespace) -> int:
    scenarios = [BY_NAME[name] for name in args.scenarios.split(",")]
    plan = Plan(
        duration=args.duration,
        warmup=min(3.0, args.duration),
        rounds=args.rounds,
        connections=args.connections,
        threads=1,
        scenarios=tuple(s.name for s in scenarios),
        case_rate=0.0,
        case_duration=0.0,
        calibration=0.0,
        calibration_scenarios=(),
        quiet_threshold=args.quiet,
        quiet_wait=args.quiet_wait if args.quiet > 0 else 0.0,
        digest_once=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="cryptd-keystore-backends-"))
    with scratch_database(args.url) as conninfo, contextlib.ExitStack() as stack:
        targets = [
            Cryptd(workdir / "file", 1, {"CRYPTD_AUDIT_LOG": "off"}, name="file"),
            Cryptd(
                workdir / "postgresql",
                1,
                {"CRYPTD_AUDIT_LOG": "off", "CRYPTD_KEYSTORE_URL": as_url(conninfo)},
                name="postgresql",
            ),
        ]
        for target in targets:
            stack.callback(target.stop)
            target.start()
        prepared = Prepared(workdir / "bodies", {})
        prepared.directory.mkdir()
        for target in targets:
            for scenario in scenarios:
                body = prepare_body(target, scenario.cryptd)
                status, data = target.request(scenario.cryptd.path, body)
                check_response(status, data, scenario.items)
                path = prepared.directory / f"{target.name}-{scenario.name}.json"
                path.write_bytes(orjson.dumps(body))
                prepared.files[(target.name, scenario.name)] = path
        runs: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
        for scenario in scenarios:
            for target in targets:
                measure(target, scenario, prepared, plan, plan.warmup)
        for round_no in range(plan.rounds):
            order = targets if round_no % 2 == 0 else targets[::-1]
            for scenario in scenarios:
                for target in order:
                    m = quietly(
                        plan,
                        partial(measure, target, scenario, prepared, plan, plan.duration),
                    )
                    runs[(scenario.name, target.name)].append(m)
                    log(f"round {round_no + 1} {scenario.name} {target.name}: {m.ops:,.0f} ops/s")
    print(
        "| scenario | file ops/s | PostgreSQL ops/s | ratio | P99 file / PostgreSQL ms |"
        " server CPU µs/req file / PostgreSQL |\n|---|--:|--:|--:|--:|--:|"
    )
    for scenario in scenarios:
        f = summarize(runs[(scenario.name, "file")], 2)
        p = summarize(runs[(scenario.name, "postgresql")], 2)
        cpu_f = f.server_cpu_per_request_us or float("nan")
        cpu_p = p.server_cpu_per_request_us or float("nan")
        print(
            f"| {scenario.name} | {f.ops:,.0f} | {p.ops:,.0f} | {p.ops / f.ops:.2f}x |"
            f" {f.p99_ms:.2f} / {p.p99_ms:.2f} | {cpu_f:.0f} / {cpu_p:.0f} |"
        )
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.keystore", description=__doc__)
    parser.add_argument("--url", default=DEFAULT_URL, help="PostgreSQL server (a scratch db)")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("propagation", help="two replicas, mixed requests, propagation P99")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="server workers per replica")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=propagation)
    b = sub.add_parser("backends", help="crypto cost on the file and on PostgreSQL")
    b.add_argument("--scenarios", default=",".join(BACKEND_SCENARIOS))
    b.add_argument("--duration", type=float, default=10.0)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--connections", type=int, default=16)
    b.add_argument("--quiet", type=float, default=0.25)
    b.add_argument("--quiet-wait", type=float, default=120.0)
    b.set_defaults(func=backends)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
