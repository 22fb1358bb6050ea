"""What metrics and the audit stream cost: throughput with them on against off, in one run.

    python -m loadtest.metrics_cost            # in-process ASGI loop and HTTP through uvicorn
    python -m loadtest.metrics_cost --quick    # in-process only

The in-process loop calls the ASGI app directly (no sockets, no HTTP parsing): it is the
harshest measure, since the app does almost nothing. The HTTP part runs uvicorn servers and wrk
against them, alternating the configurations round by round so that drift on a shared machine
hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from fastapi import FastAPI, Request
from starlette.responses import Response

from loadtest.procstat import tree_cpu_seconds
from loadtest.servers import free_port
from service.asgi import ASGIApp, Message

_KEY = AESGCM(bytes(range(32)))
_NONCE = bytes(12)
_CIPHERTEXT = _KEY.encrypt(_NONCE, b"x" * 64, None)


def build_app(audit: Any = None) -> FastAPI:
    """A trivial endpoint and a decrypt-like one (AES-GCM of 64 bytes, audited when given)."""
    app = FastAPI()

    @app.get("/v1/ping/{key}")
    async def ping(key: str) -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    @app.post("/v1/decrypt/{key}")
    async def decrypt(key: str, request: Request) -> Response:
        _KEY.decrypt(_NONCE, _CIPHERTEXT, None)
        if audit is not None:
            audit.record("decrypt", client="bench", key=key, key_version=1, outcome="ok")
        return Response(b'{"plaintext":"eHg="}', media_type="application/json")

    return app


def app_factory() -> ASGIApp:
    """uvicorn --factory entry: BENCH_METRICS=1 wraps the app; BENCH_AUDIT=<path> audits."""
    from service.api.timing import timed
    from service.logs import configure_logging
    from service.metrics import Metrics

    audit_target = os.environ.get("BENCH_AUDIT", "off")
    setup = configure_logging("warning", False, audit_target)
    app = build_app(setup.audit if setup.audit.enabled else None)
    if os.environ.get("BENCH_METRICS") == "1":
        metrics = Metrics()

        @app.get("/metrics")
        def scrape() -> Response:
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

        return timed(metrics, app)
    return app


# -- measurement ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    rate: float
    """Requests per wall-clock second."""
    cpu_us: float
    """CPU microseconds the serving process(es) spent per request, all threads included: on a
    shared machine this is the steadier figure, and for a CPU-bound server throughput is its
    inverse."""


Rounds = dict[str, list[Sample]]


def _alternate(configurations: Mapping[str, Callable[[], Sample]], rounds: int) -> Rounds:
    found: Rounds = {name: [] for name in configurations}
    for _ in range(rounds):
        for name, measure in configurations.items():
            found[name].append(measure())
    return found


def _report(title: str, rounds: Rounds, baseline: str) -> None:
    """Medians, and the cost as the median of per-round ratios: each round compares
    configurations measured seconds apart, which cancels the slow drift of a shared machine."""
    print(title)
    base = rounds[baseline]
    for name, samples in rounds.items():
        rate = statistics.median(s.rate for s in samples)
        cpu = statistics.median(s.cpu_us for s in samples)
        # Throughput a CPU-bound server loses: 1 - cpu_before / cpu_after, round by round.
        costs = [(1.0 - b.cpu_us / s.cpu_us) * 100.0 for b, s in zip(base, samples, strict=True)]
        changes = [(s.rate / b.rate - 1.0) * 100.0 for b, s in zip(base, samples, strict=True)]
        print(
            f"  {name:<18} {rate:>9,.0f} req/s ({statistics.median(changes):+5.1f} %)"
            f"  {cpu:7.1f} us CPU/request (throughput cost {statistics.median(costs):+5.1f} %,"
            f" rounds {min(costs):+.1f}..{max(costs):+.1f})"
        )


# -- in-process ----------------------------------------------------------------------------


def _asgi_rate(app: ASGIApp, method: str, path: str, seconds: float) -> Sample:
    scope_template = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"bench")], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }  # fmt: skip

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        return None

    async def loop() -> Sample:
        done = 0
        deadline = time.perf_counter() + seconds
        started, cpu_started = time.perf_counter(), time.process_time()
        while True:
            for _ in range(200):
                await app(dict(scope_template), receive, send)
            done += 200
            if time.perf_counter() >= deadline:
                wall = time.perf_counter() - started
                cpu = time.process_time() - cpu_started
                return Sample(done / wall, cpu / done * 1e6)

    return asyncio.run(loop())


def in_process(seconds: float, rounds: int) -> None:
    from service.api.timing import timed
    from service.logs import Audit, LineWriter
    from service.metrics import Metrics

    plain = build_app()
    with_metrics = timed(Metrics(), build_app())
    ping = "/v1/ping/k1"
    result = _alternate(
        {
            "metrics off": functools.partial(_asgi_rate, plain, "GET", ping, seconds),
            "metrics on": functools.partial(_asgi_rate, with_metrics, "GET", ping, seconds),
        },
        rounds,
    )
    _report(
        "in-process ASGI, trivial endpoint (no HTTP: the harshest ratio)", result, "metrics off"
    )

    with tempfile.TemporaryDirectory() as scratch:
        fd = os.open(Path(scratch) / "audit.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        writer = LineWriter(fd, owns_fd=True)
        audited = build_app(Audit(writer))
        unaudited = build_app()
        path = "/v1/decrypt/k1"
        result = _alternate(
            {
                "audit off": functools.partial(_asgi_rate, unaudited, "POST", path, seconds),
                "audit on (file)": functools.partial(_asgi_rate, audited, "POST", path, seconds),
            },
            rounds,
        )
        _report("in-process ASGI, AES-GCM decrypt endpoint", result, "audit off")
        audit = Audit(writer)
        count = 200_000
        started = time.process_time()
        for _ in range(count):
            audit.record("decrypt", client="bench", key="k1", key_version=1, outcome="ok")
        writer.flush(30)
        per_record = (time.process_time() - started) / count
        writer.close()
        print(f"  Audit.record(): {per_record * 1e6:.2f} us CPU per record, writer thread included")


def real_app(rounds: int, count: int = 1000) -> None:
    """The real application (development keyring) on signed ``POST /v1/encrypt`` requests: the
    ratio an operator sees, since authentication, JSON and AES-GCM dominate a request."""
    import base64

    import orjson

    from service.api.application import create_app
    from service.api.timing import timed
    from service.auth.signature import sign_request
    from service.cli.serve import prepare_dev_dir
    from service.config import Settings
    from service.metrics import Metrics

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "dev"
        prepare_dev_dir(directory, "http://127.0.0.1:0")
        credential = orjson.loads((directory / "client.json").read_bytes())
        secret = base64.b64decode(credential["secret"])
        app = create_app(Settings())
        instrumented = create_app(Settings())  # its own runner, keyring and executors
        metrics = Metrics()
        if not any(getattr(route, "path", None) == "/metrics" for route in instrumented.routes):
            # create_app does not wire metrics itself yet: do what it will do.
            instrumented.state.services.runner._observer = metrics.observe_crypto
        wrapped = timed(metrics, instrumented)
        path = "/v1/encrypt/aes256-gcm"
        body = orjson.dumps({"plaintext": base64.b64encode(b"x" * 64).decode()})

        def requests(n: int) -> list[tuple[list[tuple[bytes, bytes]], bytes]]:
            signed = []
            for _ in range(n):
                headers = sign_request("POST", path, "", body, credential["client_id"], secret)
                raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
                signed.append(([(b"host", b"bench"), *raw], body))
            return signed

        async def measure(target: ASGIApp) -> Sample:
            batch = requests(count)  # signed beforehand: only the server's work is timed
            statuses: list[int] = []

            async def send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            started, cpu_started = time.perf_counter(), time.process_time()
            for headers, content in batch:
                delivered = False

                async def receive(content: bytes = content) -> Message:
                    nonlocal delivered
                    if delivered:
                        return {"type": "http.disconnect"}
                    delivered = True
                    return {"type": "http.request", "body": content, "more_body": False}

                scope = {
                    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                    "method": "POST", "scheme": "http", "path": path,
                    "raw_path": path.encode(), "query_string": b"", "root_path": "",
                    "headers": headers, "client": ("127.0.0.1", 1),
                    "server": ("127.0.0.1", 80), "state": {},
                }  # fmt: skip
                await target(scope, receive, send)
            wall = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            if set(statuses) != {200}:
                raise RuntimeError(f"unexpected statuses {sorted(set(statuses))}")
            return Sample(count / wall, cpu / count * 1e6)

        async def run() -> Rounds:
            found: Rounds = {"metrics off": [], "metrics on": []}
            async with (
                app.router.lifespan_context(app),
                instrumented.router.lifespan_context(instrumented),
            ):
                for _ in range(rounds):
                    found["metrics off"].append(await measure(app))
                    found["metrics on"].append(await measure(wrapped))
            return found

        _report("in-process ASGI, real app, signed POST /v1/encrypt (AES-GCM, 64 B)",
                asyncio.run(run()), "metrics off")  # fmt: skip


# -- HTTP through uvicorn and wrk ------------------------------------------------------------


def _start(env: dict[str, str], workers: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "loadtest.metrics_cost:app_factory", "--factory",
        "--port", str(port), "--workers", str(workers), "--no-access-log", "--log-level",
        "warning", "--loop", "uvloop", "--http", "httptools",
    ]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                time.sleep(0.3 * workers)
                return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("benchmark server did not start")


_LUA_POST = """wrk.method = "POST"
wrk.body = "{}"
wrk.headers["Content-Type"] = "application/json"
"""


def _wrk(pid: int, url: str, seconds: float, script: Path | None) -> Sample:
    command = ["wrk", "-t1", "-c16", f"-d{max(1, round(seconds))}s", url]
    if script is not None:
        command[1:1] = ["-s", str(script)]
    cpu_started = tree_cpu_seconds(pid)
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    cpu = tree_cpu_seconds(pid) - cpu_started
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    total = re.search(r"(\d+) requests in", output)
    if rate is None or total is None or "Non-2xx" in output:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    return Sample(float(rate.group(1)), cpu / int(total.group(1)) * 1e6)


def over_http(seconds: float, rounds: int, workers: int) -> None:
    if shutil.which("wrk") is None:
        print("wrk not found: HTTP benchmark skipped")
        return
    with tempfile.TemporaryDirectory() as scratch:
        scratch_path = Path(scratch)
        script = scratch_path / "post.lua"
        script.write_text(_LUA_POST)
        metrics_env = {"BENCH_METRICS": "1"}
        if workers > 1:
            metrics_dir = scratch_path / "metrics"
            metrics_dir.mkdir(mode=0o700)
            metrics_env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        servers = {
            "metrics off": _start({"BENCH_METRICS": "0"}, workers),
            "metrics on": _start(metrics_env, workers),
            "audit on (file)": _start({"BENCH_AUDIT": str(scratch_path / "audit.log")}, workers),
        }
        try:
            ping = {
                name: functools.partial(_wrk, process.pid, url + "/v1/ping/k1", seconds, None)
                for name, (process, url) in servers.items()
                if name.startswith("metrics")
            }
            _report(f"HTTP, uvicorn {workers} worker(s), trivial endpoint",
                    _alternate(ping, rounds), "metrics off")  # fmt: skip
            decrypt = {
                name: functools.partial(_wrk, process.pid, url + "/v1/decrypt/k1", seconds, script)
                for name, (process, url) in servers.items()
                if name in ("metrics off", "audit on (file)")
            }
            _report(f"HTTP, uvicorn {workers} worker(s), AES-GCM decrypt endpoint",
                    _alternate(decrypt, rounds), "metrics off")  # fmt: skip
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="in-process measurements only")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    parser.add_argument("--rounds", type=int, default=10, help="alternations per configuration")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers (HTTP part)")
    args = parser.parse_args()
    in_process(args.seconds / 2, args.rounds)
    real_app(args.rounds)
    if not args.quick:
        over_http(args.seconds, args.rounds, args.workers)


if __name__ == "__main__":
    main()
