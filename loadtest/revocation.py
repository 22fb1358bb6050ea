"""Is a key taken away when the answer says so? ``python -m loadtest.revocation``.

Two campaigns against real servers (``cryptd serve --dev``, two workers each), one keep-alive
connection pinned to every worker:

- ``host --store file|postgresql --rounds 1000``: one server. Each round creates a key, has
  every worker encrypt under it, deletes or disables it on one worker and at once asks the
  other to encrypt (and, after a delete, for a backup). Counted: rounds in which the other
  worker served (goal 0).
- ``replicas --rounds 200``: two servers on one PostgreSQL, under a steady wrk load of signed
  encryptions on both (``--no-load`` without). Each round creates a key, starts a probe per
  worker (four) encrypting under it in a loop, takes it away (delete or disable) on one worker
  and records when the answer arrived, what its ``X-Cryptd-Propagation`` header said, and for
  every probe: any encryption sent after the answer and served (goal 0), when its first
  refusal after the answer came back, and when its last served encryption was sent. Each
  worker began refusing between those two moments; reported are P50/P99/max of the time from
  the answer to the last worker's first refusal (an upper bound: the probe's own round trip is
  in it), to the latest served send (a lower bound; negative: before the answer), and of the
  answer's wait for the other replica.

The report (JSON) goes to ``loadtest/results/``; the summary is printed.

Over 400 lines as one module: both campaigns drive the same lanes, servers and percentile
summary, and the command line picks between them; split, each half would import the other's
pieces.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.keystore import as_url, scratch_database
from loadtest.measure import WrkStream, find_wrk
from loadtest.phase import describe, rsa_sign_us
from loadtest.targets import Cryptd
from service.auth.signature import sign_request

RESULTS = Path(__file__).resolve().parent / "results"
PLAINTEXT = base64.b64encode(b"revocation").decode()
ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass
class Lane:
    """One worker of one server, reached through one kept-alive connection."""

    name: str
    server: Cryptd
    conn: httpx.Client

    def send(self, method: str, path: str, body: Any = None) -> httpx.Response:
        content = b"" if body is None else orjson.dumps(body)
        headers = sign_request(method, path, "", content, self.server.client_id, self.server.secret)
        return self.conn.request(method, path, content=content, headers=headers)

    def encrypt(self, key: str) -> httpx.Response:
        return self.send("POST", f"/v1/encrypt/{key}", {"plaintext": PLAINTEXT})

    def create(self, key: str) -> None:
        response = self.send(
            "POST", f"/v1/keys/{key}", {"type": "aes256-gcm", "deletion_allowed": True}
        )
        if response.status_code != 201:
            raise RuntimeError(f"create {key}: {response.status_code} {response.text}")

    def take_away(self, key: str, action: str) -> httpx.Response:
        if action == "delete":
            return self.send("DELETE", f"/v1/keys/{key}")
        return self.send("PATCH", f"/v1/keys/{key}", {"state": "disabled"})


@contextlib.contextmanager
def lanes_of(server: Cryptd, workers: int, prefix: str) -> Iterator[list[Lane]]:
    """A connection to each worker (opened until /readyz has named every index)."""
    found: dict[int, httpx.Client] = {}
    spare: list[httpx.Client] = []
    try:
        deadline = time.monotonic() + 30
        while len(found) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"reached workers {sorted(found)} of {workers} only")
            conn = httpx.Client(
                base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=1)
            )
            index = conn.get("/readyz").json()["checks"]["server"]["worker"]
            (spare.append(conn) if index in found else found.__setitem__(index, conn))
        yield [Lane(f"{prefix}{i}", server, found[i]) for i in sorted(found)]
    finally:
        for conn in [*found.values(), *spare]:
            conn.close()


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values, 0.5) * 1000, 3),
        "p99_ms": round(percentile(values, 0.99) * 1000, 3),
        "max_ms": round(max(values, default=float("nan")) * 1000, 3),
    }


# One host ---------------------------------------------------------------------------------


@dataclass
class HostReport:
    store: str
    rounds: int
    served_after_delete: int = 0  # encrypt or backup answered 2xx by the other worker
    served_after_disable: int = 0
    unexpected: list[str] = field(default_factory=list)


def host_campaign(lanes: list[Lane], store: str, rounds: int) -> HostReport:
    report = HostReport(store, rounds)
    for n in range(rounds):
        acting, other = (lanes[0], lanes[1]) if n % 2 == 0 else (lanes[1], lanes[0])
        key = f"r{n}-{uuid.uuid4().hex[:8]}"
        acting.create(key)
        for lane in lanes:
            if lane.encrypt(key).status_code != 200:
                report.unexpected.append(f"{key}: not served before the change")
        action = "delete" if n % 2 == 0 else "disable"
        answer = acting.take_away(key, action)
        if answer.status_code not in (200, 204):
            report.unexpected.append(f"{key}: {action} answered {answer.status_code}")
            continue
        served = other.encrypt(key).status_code == 200
        if action == "delete":
            served = other.send("GET", f"/v1/keys/{key}/backup").status_code == 200 or served
            report.served_after_delete += served
        else:
            report.served_after_disable += served
        if (n + 1) % 100 == 0:
            print(f"  {store}: {n + 1} rounds", file=sys.stderr)
    return report


# Replicas under load ------------------------------------------------------------------------


@dataclass
class Probe:
    started: float
    answered: float
    status: int


@dataclass
class RoundResult:
    key: str
    action: str
    acting: str
    header: str
    answer_wait_s: float  # the answer's own wait for the other replica (from its header)
    served_after: int  # probe encryptions sent after the answer and served
    last_refusal_s: float  # from the answer to the last worker's first refusal back
    last_served_s: float  # from the answer to the latest send that was served (< 0: before)


def probe_round(lanes: list[Lane], n: int) -> RoundResult:
    key = f"p{n}-{uuid.uuid4().hex[:8]}"
    acting = lanes[n % len(lanes)]
    acting.create(key)
    for lane in lanes:
        lane.encrypt(key)
    stop = threading.Event()
    seen: dict[str, list[Probe]] = {lane.name: [] for lane in lanes}

    def probe(lane: Lane) -> None:
        while not stop.is_set():
            started = time.monotonic()
            status = lane.encrypt(key).status_code
            seen[lane.name].append(Probe(started, time.monotonic(), status))

    threads = [threading.Thread(target=probe, args=(lane,), daemon=True) for lane in lanes]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    action = "delete" if n % 2 == 0 else "disable"
    # The change goes over a connection of its own to the acting worker's server; which worker
    # takes it is the kernel's choice, as for any client.
    with httpx.Client(base_url=acting.server.url, timeout=30) as conn:
        answer = Lane(acting.name, acting.server, conn).take_away(key, action)
    answered = time.monotonic()
    time.sleep(0.1)
    stop.set()
    for thread in threads:
        thread.join(30)
    header = answer.headers.get("x-cryptd-propagation", "")
    fields = dict(part.strip().split("=", 1) for part in header.split(",") if "=" in part)
    served_after = 0
    last = 0.0
    last_served = float("-inf")
    for probes_of in seen.values():
        served_after += sum(1 for p in probes_of if p.started > answered and p.status == 200)
        refusals = [p.answered for p in probes_of if p.answered >= answered and p.status != 200]
        last = max(last, (min(refusals) - answered) if refusals else float("inf"))
        served = [p.started for p in probes_of if p.status == 200]
        last_served = max(last_served, max(served, default=float("-inf")) - answered)
    return RoundResult(
        key,
        action,
        acting.name,
        header,
        float(fields.get("waited", "nan")),
        served_after,
        last,
        last_served,
    )


@contextlib.contextmanager
def database(admin_url: str) -> Iterator[str]:
    """A database of this run's own (dropped afterwards), as a ``postgresql://`` URL."""
    with scratch_database(admin_url) as conninfo:
        yield as_url(conninfo)


@contextlib.contextmanager
def wrk_load(servers: Sequence[Cryptd], connections: int) -> Iterator[None]:
    """Signed AES-GCM encryptions on every server until the block ends (wrk, on CPU 0 where
    there are two)."""
    wrk = find_wrk()
    if wrk is None:
        raise RuntimeError("the load needs wrk (apt-get install -y wrk), or pass --no-load")
    processes = []
    for server in servers:
        stream = WrkStream("cryptd.lua", server.url, ["aes-encrypt"], connections)
        command = [wrk, "-t1", f"-c{stream.connections}", "-d3600s", "-s"]
        command += [str(Path(__file__).resolve().parent / "wrk" / stream.script), stream.url]
        command += ["--", *stream.args]
        if (os.cpu_count() or 1) >= 2 and shutil.which("taskset"):
            command = ["taskset", "-c", "0", *command]
        env = {**os.environ, "CRYPTD_CREDENTIALS": str(server.credentials)}
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
    try:
        time.sleep(1.0)
        yield
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)


def prefill(url: str, dev: Path, keys: int) -> None:
    """``keys`` keys of two versions each in the store, as one change (a campaign's keyring:
    what a worker reads on every change is what is measured)."""
    from loadtest.refresh_cost import populate
    from service.config import decode_master_key
    from service.keys.manager import KeyManager
    from service.keys.masterkey import MasterKey
    from service.keys.pgstore import PostgresKeyStore

    master = MasterKey(decode_master_key((dev / "master.key").read_text(), "master.key"))
    store = PostgresKeyStore(url)
    try:
        manager = KeyManager(store, master)
        manager.load()
        populate(manager, keys)
    finally:
        store.close()


def replicas_campaign(rounds: int, load: bool, admin_url: str, keys: int = 0) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="cryptd-revocation-") as scratch,
        database(admin_url) as url,
    ):
        env = {"CRYPTD_KEYSTORE_URL": url, "CRYPTD_PROPAGATION_TIMEOUT": "2"}
        cpus = frozenset({1}) if (os.cpu_count() or 1) >= 2 else None
        first = Cryptd(Path(scratch) / "a", workers=2, env=env, cpus=cpus, name="a")
        first.start()
        if keys:
            prefill(url, Path(scratch) / "a" / "dev", keys)
        second_dev = Path(scratch) / "b" / "dev"
        second_dev.mkdir(parents=True)
        for name in ("master.key", "clients.json"):
            shutil.copy2(Path(scratch) / "a" / "dev" / name, second_dev / name)
        second = Cryptd(Path(scratch) / "b", workers=2, env=env, cpus=cpus, name="b")
        second.start()
        try:
            with lanes_of(first, 2, "a") as on_a, lanes_of(second, 2, "b") as on_b:
                lanes = on_a + on_b
                deadline = time.monotonic() + 20
                while "replicas=2" not in (first_header := _probe_header(lanes[0])):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the replicas never saw each other: {first_header}")
                    time.sleep(0.5)
                with wrk_load([first, second], 8) if load else contextlib.nullcontext():
                    results = []
                    for n in range(rounds):
                        results.append(probe_round(lanes, n))
                        if (n + 1) % 50 == 0:
                            print(f"  replicas: {n + 1} rounds", file=sys.stderr)
        finally:
            second.stop()
            first.stop()
    complete = sum(1 for r in results if "confirmed=2" in r.header and "replicas=2" in r.header)
    return {
        "rounds": rounds,
        "load": load,
        "keys_before": keys,
        "served_after_answer": sum(r.served_after for r in results),
        "answers_confirmed_by_both": complete,
        "answer_to_last_refusal": spread([r.last_refusal_s for r in results]),
        "answer_to_last_served_send": spread([r.last_served_s for r in results]),
        "answer_wait_for_other_replica": spread([r.answer_wait_s for r in results]),
        "rounds_detail": [asdict(r) for r in results],
    }


def _probe_header(lane: Lane) -> str:
    key = f"hello-{uuid.uuid4().hex[:8]}"
    lane.create(key)
    return str(lane.take_away(key, "delete").headers.get("x-cryptd-propagation", ""))


# What the check costs a request -------------------------------------------------------------


def check_cost(rounds: int = 7, number: int = 2_000_000) -> dict[str, Any]:
    """The comparison every request makes before it uses a key (``board[0] > generation``,
    the board mapped from a file as ``cryptd serve`` gives it), timed against an empty
    statement in the same process, alternating, ``rounds`` times; and the whole key lookup a
    request makes (``CryptoRunner.key``) with the board at the snapshot's generation."""
    import asyncio
    import timeit

    from service.keys.admin import initialise
    from service.keys.board import Board
    from service.keys.filestore import FileKeyStore
    from service.keys.manager import KeyManager
    from service.keys.masterkey import MasterKey
    from service.runner import CryptoRunner

    with tempfile.TemporaryDirectory(prefix="cryptd-revocation-") as scratch:
        master = MasterKey(os.urandom(32))
        store = FileKeyStore(Path(scratch) / "keyring.json")
        initialise(store, master)
        board = Board(Path(scratch) / "keyring.board")
        manager = KeyManager(store, master, board=board)
        manager.load()
        manager.create("k", "aes256-gcm")
        runner = CryptoRunner(manager, {}, chunk_size=8)
        names = {"board": board.cell, "keyring": manager.keyring}
        check, empty = [], []
        for _ in range(rounds):
            check.append(
                timeit.timeit("board[0] > keyring.generation", globals=names, number=number)
            )
            empty.append(timeit.timeit("pass", globals=names, number=number))

        async def lookups(count: int) -> float:
            started = time.perf_counter()
            for _ in range(count):
                await runner.key("k")
            return time.perf_counter() - started

        lookup = [asyncio.run(lookups(number // 10)) for _ in range(rounds)]
        board.close()
    per = [(c - e) / number * 1e9 for c, e in zip(check, empty, strict=True)]
    return {
        "rounds": rounds,
        "statements_per_round": number,
        "check_ns": sorted(round(p, 2) for p in per),
        "check_ns_median": round(statistics.median(per), 2),
        "key_lookup_ns_median": round(statistics.median(lookup) / (number // 10) * 1e9, 1),
    }


# Entry ------------------------------------------------------------------------------------


def run_host(store: str, rounds: int, admin_url: str) -> HostReport:
    on_postgres = database(admin_url) if store == "postgresql" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="cryptd-revocation-") as scratch, on_postgres as url:
        env = {"CRYPTD_KEYSTORE_URL": url} if url else {}
        server = Cryptd(Path(scratch), workers=2, env=env)
        server.start()
        try:
            with lanes_of(server, 2, "w") as lanes:
                return host_campaign(lanes, store, rounds)
        finally:
            server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.revocation", description=__doc__)
    sub = parser.add_subparsers(dest="campaign", required=True)
    host = sub.add_parser("host", help="one server of two workers")
    host.add_argument("--store", choices=("file", "postgresql", "both"), default="both")
    host.add_argument("--rounds", type=int, default=1000)
    rep = sub.add_parser("replicas", help="two servers on one PostgreSQL, under load")
    rep.add_argument("--rounds", type=int, default=200)
    rep.add_argument("--no-load", action="store_true")
    rep.add_argument(
        "--keys", type=int, default=0, help="keys (two versions each) in the store beforehand"
    )
    sub.add_parser("cost", help="what the board comparison costs a request (in-process)")
    for p in (host, rep):
        p.add_argument("--admin-url", default=ADMIN_URL, help=f"PostgreSQL ({ADMIN_URL})")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    phase = rsa_sign_us()
    print(f"host phase: {describe(phase)}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    report: dict[str, Any]
    if args.campaign == "cost":
        report = {"campaign": "cost", **check_cost()}
        print(
            f"board check: {report['check_ns_median']} ns a request (median of "
            f"{report['rounds']} alternating rounds: {report['check_ns']}); the whole key "
            f"lookup: {report['key_lookup_ns_median']} ns"
        )
        failed = False
    elif args.campaign == "host":
        stores = ("file", "postgresql") if args.store == "both" else (args.store,)
        reports = [run_host(store, args.rounds, args.admin_url) for store in stores]
        report = {"campaign": "host", "stores": [asdict(r) for r in reports]}
        for r in reports:
            print(
                f"{r.store}: {r.rounds} rounds, served after an acknowledged delete: "
                f"{r.served_after_delete}, after a disable: {r.served_after_disable}"
                + (f", unexpected: {r.unexpected[:3]}" if r.unexpected else "")
            )
        failed = any(
            r.served_after_delete or r.served_after_disable or r.unexpected for r in reports
        )
    else:
        report = {
            "campaign": "replicas",
            **replicas_campaign(args.rounds, not args.no_load, args.admin_url, args.keys),
        }
        print(
            f"replicas: {report['rounds']} rounds ({'under load' if report['load'] else 'idle'}), "
            f"served after the answer: {report['served_after_answer']}, confirmed by both: "
            f"{report['answers_confirmed_by_both']}\n"
            f"  answer -> last worker refusing (upper bound, probe round trip included): "
            f"{report['answer_to_last_refusal']}\n"
            f"  answer -> latest served send (negative: every worker refused before): "
            f"{report['answer_to_last_served_send']}\n"
            f"  answer's wait for the other replica: {report['answer_wait_for_other_replica']}"
        )
        failed = report["served_after_answer"] > 0
    report["phase_rsa2048_sign_us"] = phase
    path = RESULTS / f"revocation-{args.campaign}-{stamp}.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
