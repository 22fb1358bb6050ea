"""cryptd's own CPU per request, in-process: ``python -m loadtest.hotpath [SCENARIO ...]``.

The application is built as ``cryptd serve`` builds it (development keyring, request signing,
metrics on, the audit log to a file, the host replay store (LMDB) as ``cryptd serve`` gives it
to its workers; ``--redis`` for Redis, ``--memory-replay`` for one process's store) and driven
directly over ASGI with requests signed beforehand, ``--concurrency`` in flight at a time (one
task per request, as uvicorn runs them). What is timed is the application alone: no sockets,
no HTTP parsing, no load generator. Two measures:

- **CPU** (default): ``time.process_time()`` per request (all threads of this process: the
  audit writer included), median over ``--repeats`` rounds. On a shared machine CPU time is
  steadier than wall-clock throughput, but still moves with cache and frequency effects.
- **Instructions** (``--callgrind``): the same run under ``valgrind --tool=callgrind`` twice, with
  two request counts; the difference divided by the difference in requests is the instruction
  count of one request, start-up and signing excluded. It repeats to within a fraction of a
  percent whatever else runs on the machine: compare two trees with it.

Every operation's instruction count is held to a committed budget in CI
(``loadtest/instructions.py``; ``--record-budget`` re-records it, ``--check-budget`` checks).

The HTTP server's own share (uvicorn, uvloop, httptools) is measured from outside by the
runner's bare-ASGI ceiling (``python -m loadtest.run``).

Over 400 lines as one module: the CPU and the instruction measures drive the one application
builder and request driver, and the callgrind runs re-enter this module as their program.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from loadtest.scenarios import BY_NAME, Scenario

DEFAULT_SCENARIOS: Final = ("aes-encrypt", "aes-decrypt", "rsa-sign", "ed25519-sign", "aes-batch")
Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class HotPath:
    scenario: str
    requests: int
    concurrency: int
    cpu_us: float  # median CPU per request (process_time)
    wall_us: float  # median wall time per request
    spread: float  # (max - min) / median of the rounds' CPU figures
    rounds: list[float]


@contextlib.contextmanager
def application(
    redis_url: str | None = None,
    audit: bool = True,
    dev_dir: Path | None = None,
    memory_replay: bool = False,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """(app, credential) of a cryptd built in a private development directory (``dev_dir``
    when given: an existing one is reused, so no keys are generated); ``extra_env`` is set
    last, over this function's own choices (e.g. ``CRYPTD_METRICS=false``)."""
    from service.cli.serve import prepare_dev_dir

    with tempfile.TemporaryDirectory(prefix="cryptd-hotpath-") as scratch:
        directory = dev_dir or Path(scratch) / "dev"
        saved = dict(os.environ)
        try:
            with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                prepare_dev_dir(directory, "http://127.0.0.1:0")
            os.environ["CRYPTD_METRICS"] = "true"
            os.environ["CRYPTD_AUDIT_LOG"] = str(Path(scratch) / "audit.log") if audit else "off"
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            # The loop-lag check stays on (its cost is per request) but must not refuse work
            # when this shared machine deschedules the process for a moment.
            os.environ["CRYPTD_MAX_LOOP_LAG"] = "30"
            if redis_url:
                os.environ["CRYPTD_REDIS_URL"] = redis_url
            else:
                os.environ.pop("CRYPTD_REDIS_URL", None)
            # The store cryptd serve gives its workers: its write per request is part of the
            # cost (one LMDB transaction per loop iteration, system calls included).
            os.environ.pop("CRYPTD_REPLAY_DIR", None)
            if not redis_url and not memory_replay:
                from service.auth.replay_host import HostReplayStore

                replay_dir = Path(scratch) / "replay"
                # Created with its clients, as cryptd serve --dev does: no start-up window.
                HostReplayStore(replay_dir, epoch=0).close()
                os.environ["CRYPTD_REPLAY_DIR"] = str(replay_dir)
            # The keyring generation board cryptd serve gives its workers (shared memory): its
            # comparison before every key use is part of the cost.
            os.environ["CRYPTD_RUNTIME_DIR"] = str(Path(scratch))
            os.environ.update(extra_env or {})
            from service.api.application import create_app
            from service.config import Settings

            app = create_app(Settings())
            credential = orjson.loads((directory / "client.json").read_bytes())
            yield app, credential
        finally:
            os.environ.clear()
            os.environ.update(saved)


def prepare(dev_dir: Path) -> None:
    """Make ``dev_dir``'s development state (keys, the audit trail's own keys) as a server's
    first start does, then stop that server. Its lifespan's end closes what building the
    application opened: an application never started keeps its audit writer running, which
    then fails to write its checkpoint into the directory application() has removed."""

    async def start_and_stop() -> None:
        with application(dev_dir=dev_dir) as (app, _credential):
            async with app.router.lifespan_context(app):
                pass

    asyncio.run(start_and_stop())


def scope_for(path: str, headers: Headers) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8080),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
        "state": {},
    }


class Driver:
    """Signed requests for one scenario, and the ASGI calls that answer them."""

    def __init__(self, app: Any, credential: dict[str, Any], scenario: Scenario) -> None:
        self.app = app
        self.client_id = credential["client_id"]
        self.secret = base64.b64decode(credential["secret"])
        self.scenario = scenario
        self.path = scenario.cryptd.path
        self.body = b""
        self.statuses: dict[int, int] = {}

    async def prepare(self) -> None:
        endpoint = self.scenario.cryptd
        ciphertext = None
        if endpoint.encrypt_path is not None:
            status, answer = await self.call(
                endpoint.encrypt_path, orjson.dumps(endpoint.encrypt_body or {})
            )
            if status != 200:
                raise RuntimeError(f"preparing {self.scenario.name}: {status} {answer!r}")
            ciphertext = endpoint.made_in(orjson.loads(answer))
        self.body = orjson.dumps(endpoint.body(ciphertext))
        status, answer = await self.call(self.path, self.body)
        if status != 200:
            raise RuntimeError(f"{self.scenario.name}: {status} {answer!r}")

    def sign(self, count: int) -> list[Headers]:
        from service.auth.signature import sign_request

        signed = []
        for _ in range(count):
            headers = sign_request("POST", self.path, "", self.body, self.client_id, self.secret)
            signed.append(
                [
                    (b"host", b"127.0.0.1:8080"),
                    (b"user-agent", b"wrk"),
                    (b"content-length", str(len(self.body)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items()),
                ]
            )
        return signed

    async def call(self, path: str, body: bytes) -> tuple[int, bytes]:
        from service.auth.signature import sign_request

        headers = sign_request("POST", path, "", body, self.client_id, self.secret)
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                chunks.append(message.get("body", b""))

        await self.app(scope_for(path, raw), receive, send)
        return status, b"".join(chunks)

    async def one(self, headers: Headers) -> None:
        body = self.body
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                await asyncio.sleep(3600)  # like a server: nothing more until disconnect
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                self.statuses[status] = self.statuses.get(status, 0) + 1

        await self.app(scope_for(self.path, headers), receive, send)

    async def drive(self, signed: Sequence[Headers], concurrency: int) -> None:
        # Signing ran on the loop just before: let the loop-lag timer (service/pool/lag.py)
        # catch up, or the first requests would be refused as if the server were overloaded.
        await asyncio.sleep(0.03)
        loop = asyncio.get_running_loop()
        for start in range(0, len(signed), concurrency):
            wave = [loop.create_task(self.one(h)) for h in signed[start : start + concurrency]]
            await asyncio.gather(*wave)


async def _measure(
    driver: Driver, requests: int, concurrency: int, repeats: int, warmup: int
) -> HotPath:
    await driver.prepare()
    await driver.drive(driver.sign(warmup), concurrency)
    cpu_rounds, wall_rounds = [], []
    for _ in range(repeats):
        signed = driver.sign(requests)
        driver.statuses.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        await driver.drive(signed, concurrency)
        cpu_rounds.append((time.process_time() - cpu) / requests * 1e6)
        wall_rounds.append((time.perf_counter() - wall) / requests * 1e6)
        if driver.statuses != {200: requests}:
            raise RuntimeError(f"{driver.scenario.name}: statuses {driver.statuses}")
    median = statistics.median(cpu_rounds)
    return HotPath(
        scenario=driver.scenario.name,
        requests=requests,
        concurrency=concurrency,
        cpu_us=median,
        wall_us=statistics.median(wall_rounds),
        spread=(max(cpu_rounds) - min(cpu_rounds)) / median if median else 0.0,
        rounds=cpu_rounds,
    )


def measure(
    scenarios: Sequence[str],
    *,
    requests: int = 2000,
    concurrency: int = 16,
    repeats: int = 5,
    warmup: int = 500,
    redis_url: str | None = None,
    audit: bool = True,
    memory_replay: bool = False,
) -> list[HotPath]:
    """CPU per request of each scenario, one application for all of them."""
    import uvloop

    async def run() -> list[HotPath]:
        with application(redis_url, audit, memory_replay=memory_replay) as (app, credential):
            async with app.router.lifespan_context(app):
                return [
                    await _measure(
                        Driver(app, credential, BY_NAME[name]),
                        requests,
                        concurrency,
                        repeats,
                        warmup,
                    )
                    for name in scenarios
                ]

    return uvloop.run(run())


# --------------------------------------------------------------------------------------------
# Instruction counts under callgrind


async def _fixed_run(
    dev_dir: Path,
    scenario: str,
    requests: int,
    signed_count: int,
    concurrency: int,
    warmup: int,
    audit: bool = True,
) -> None:
    with application(audit=audit, dev_dir=dev_dir) as (app, credential):
        async with app.router.lifespan_context(app):
            driver = Driver(app, credential, BY_NAME[scenario])
            await driver.prepare()
            await driver.drive(driver.sign(warmup), concurrency)
            # Both runs sign the same number of requests, so signing cancels out.
            signed = driver.sign(signed_count)
            await driver.drive(signed[:requests], concurrency)
            if driver.statuses.get(200, 0) != warmup + requests:
                raise RuntimeError(f"{scenario}: statuses {driver.statuses}")


_TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def instructions(
    scenario: str,
    *,
    low: int = 200,
    high: int = 1200,
    concurrency: int = 16,
    warmup: int = 300,
    audit: bool = True,
    keep: Path | None = None,
) -> float:
    """Instructions per request (callgrind), from two runs of ``low`` and ``high`` requests
    (``keep``: a directory that receives both callgrind files, for callgrind_annotate)."""
    counts = []
    with tempfile.TemporaryDirectory(prefix="cryptd-callgrind-") as scratch:
        dev_dir = Path(scratch) / "dev"  # keys generated once, outside the counted runs
        prepare(dev_dir)
        for requests in (low, high):
            out = Path(scratch) / f"callgrind.{requests}"
            command = [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "loadtest.hotpath",
                "--fixed-run",
                f"{dev_dir}:{scenario}:{requests}:{high}:{concurrency}:{warmup}:{int(audit)}",
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"callgrind run failed: {done.stderr[-2000:]}")
            found = _TOTALS.search(out.read_text())
            if found is None:
                raise RuntimeError("no totals in the callgrind output")
            counts.append(int(found.group(1)))
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                out.replace(keep / f"callgrind.{scenario}.{'audit' if audit else 'off'}.{requests}")
    return (counts[1] - counts[0]) / (high - low)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.hotpath", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("scenarios", nargs="*", help=f"default: {' '.join(DEFAULT_SCENARIOS)}")
    parser.add_argument("--requests", type=int, default=2000, help="per round (2000)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, median kept (5)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--redis", help="replay store URL (default: the host store, LMDB)")
    parser.add_argument(
        "--memory-replay", action="store_true", help="one process's replay store (in memory)"
    )
    parser.add_argument("--no-audit", action="store_true", help="audit log off")
    parser.add_argument("--callgrind", action="store_true", help="instructions per request")
    parser.add_argument(
        "--keep", type=Path, help="with --callgrind: keep the callgrind files in this directory"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--record-budget",
        action="store_true",
        help="measure every operation's instructions (twice) and write "
        "loadtest/budgets/instructions-<interpreter>.json (loadtest/instructions.py)",
    )
    parser.add_argument("--check-budget", action="store_true", help="this tree against that budget")
    parser.add_argument("--fixed-run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record_budget or args.check_budget:
        from loadtest import instructions as guard

        if args.record_budget:
            budget = guard.record()
            for name, entry in budget["operations"].items():
                print(f"{name}: {entry['instructions']:,} (spread {entry['spread']:.2%})")
            return 0
        ok, text = guard.check(args.scenarios or None)
        print(text)
        return 0 if ok else 1
    if args.fixed_run:
        directory, name, requests, signed, concurrency, warmup, audit = args.fixed_run.split(":")
        import uvloop

        uvloop.run(
            _fixed_run(
                Path(directory),
                name,
                int(requests),
                int(signed),
                int(concurrency),
                int(warmup),
                audit=audit == "1",
            )
        )
        return 0
    names = args.scenarios or list(DEFAULT_SCENARIOS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    if args.callgrind:
        rows = {
            name: instructions(
                name, concurrency=args.concurrency, audit=not args.no_audit, keep=args.keep
            )
            for name in names
        }
        if args.json:
            print(orjson.dumps(rows).decode())
        else:
            for name, count in rows.items():
                print(f"{name}: {count:,.0f} instructions per request")
        return 0
    results = measure(
        names,
        requests=args.requests,
        concurrency=args.concurrency,
        repeats=args.repeats,
        warmup=args.warmup,
        redis_url=args.redis,
        audit=not args.no_audit,
        memory_replay=args.memory_replay,
    )
    if args.json:
        print(orjson.dumps([asdict(r) for r in results]).decode())
        return 0
    print("| scenario | CPU us/request | wall us/request | spread |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r.scenario} | {r.cpu_us:.1f} | {r.wall_us:.1f} | {r.spread:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
