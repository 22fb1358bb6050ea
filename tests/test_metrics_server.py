"""A real uvicorn server with two worker processes: after a known load, /metrics (whichever
worker answers) counts exactly what was sent, the window quantiles agree with the latencies the
client measured and with the histogram, and a killed and restarted worker double counts
nothing."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics.window import RELATIVE_ACCURACY
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
PING = "/v1/ping/{key}"
DECRYPT = "/v1/decrypt/{key}"

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str

    def scrape(self) -> Samples:
        response = httpx.get(self.url + "/metrics", timeout=10)
        assert response.status_code == 200
        found: Samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                found[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return found

    def workers(self) -> list[int]:
        """Pids of the uvicorn worker processes (spawned children running spawn_main)."""
        pids = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    pids.append(int(child))
        return sorted(pids)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir(mode=0o700)
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "BENCH_METRICS": "1",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    command = [
        sys.executable, "-m", "uvicorn", "loadtest.metrics_cost:app_factory", "--factory",
        "--port", str(port), "--workers", "2", "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env)
    running = Server(process, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while len(running.workers()) < 2 or not _answers(running.url):
            assert process.poll() is None, "server exited"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/v1/ping/ready", timeout=1).status_code == 200
    return False


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def send(url: str, count: int, *, path: str = "/v1/ping/k", method: str = "GET") -> list[float]:
    """``count`` requests over 8 connections; returns each one's client-side latency."""

    # One connection per request: keep-alive under ``uvicorn --workers`` can lose TCP_NODELAY
    # and wait on delayed ACKs, which would only slow the test down.
    with httpx.Client(headers={"connection": "close"}, timeout=30) as http:

        def one(index: int) -> float:
            body: dict[str, str] | None = {} if method == "POST" else None
            started = time.perf_counter()
            response = http.request(method, f"{url}{path}{index}", json=body)
            elapsed = time.perf_counter() - started
            assert response.status_code in (200, 404, 405)
            return elapsed

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, range(count)))


def requests_total(found: Samples, route: str, method: str, status: str) -> float:
    labels = {"route": route, "method": method, "status": status}
    return value(found, "cryptd_http_requests_total", **labels)


def settled_scrape(server: Server, route: str, expected: int) -> Samples:
    """Scrape until every worker has published its latency window (at most once a second)."""
    deadline = time.monotonic() + 15
    while True:
        found = server.scrape()
        window = value(found, "cryptd_http_request_window_observations", route=route, method="GET")
        if window >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def test_counts_are_exact_and_quantiles_agree_with_the_client(server: Server) -> None:
    ready = server.scrape()
    baseline = requests_total(ready, PING, "GET", "200")  # the readiness probes
    client = send(server.url, 600)
    send(server.url, 40, path="/v1/decrypt/k", method="POST")
    send(server.url, 7, path="/nope/")
    send(server.url, 5, path="/v1/decrypt/k", method="GET")

    expected_ping = baseline + 600
    for _ in range(4):  # whichever worker answers, the totals are the service's
        found = server.scrape()
        assert requests_total(found, PING, "GET", "200") == expected_ping
        assert requests_total(found, DECRYPT, "POST", "200") == 40
        assert requests_total(found, "unmatched", "GET", "404") == 7
        assert requests_total(found, DECRYPT, "GET", "405") == 5
    found = settled_scrape(server, PING, int(expected_ping))
    # Both workers served (each published its window): the merge was across processes.
    assert len(list(Path(server_dir(server)).glob("window_*.json"))) >= 2
    route = {"route": PING, "method": "GET"}
    assert value(found, "cryptd_http_request_window_observations", **route) == expected_ping
    histogram = {"route": PING, "method": "GET", "status": "200"}
    count = value(found, "cryptd_http_request_duration_seconds_count", **histogram)
    assert count == expected_ping
    edges = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in found.items()
        if name == "cryptd_http_request_duration_seconds_bucket"
        and {k: v for k, v in labels if k != "le"} == histogram
    )
    tolerance = 1 + RELATIVE_ACCURACY
    for q in (0.5, 0.99):
        gauge = value(found, "cryptd_http_request_duration_window_seconds", quantile=repr(q),
                      **route)  # fmt: skip
        rank = math.floor(q * (count - 1))
        # Same observations, counted exactly by the histogram: the rank's bucket bounds them.
        upper_index = next(i for i, (_, cumulative) in enumerate(edges) if cumulative > rank)
        lower = edges[upper_index - 1][0] if upper_index else 0.0
        upper = edges[upper_index][0]
        assert lower / tolerance <= gauge <= upper * tolerance, (q, lower, gauge, upper)
        # The server's time for each request is within what the client waited for it, so
        # its order statistics are too (the few readiness probes the client did not time can
        # only lower the server's order statistic at a given rank).
        client_q = sorted(client)[min(len(client) - 1, rank)]
        assert gauge <= client_q * tolerance, (q, gauge, client_q)


def server_dir(server: Server) -> str:
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
    for entry in environ:
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return entry.split(b"=", 1)[1].decode()
    raise AssertionError("no multiprocess directory")


def test_a_killed_and_restarted_worker_double_counts_nothing(server: Server) -> None:
    baseline = requests_total(server.scrape(), PING, "GET", "200")
    send(server.url, 300)
    before = server.scrape()
    assert requests_total(before, PING, "GET", "200") == baseline + 300

    victim = server.workers()[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # uvicorn notices and starts a replacement
        workers = server.workers()
        if len(workers) == 2 and victim not in workers and _answers(server.url):
            break
        assert time.monotonic() < deadline, "no replacement worker"
        time.sleep(0.2)
    probes = requests_total(server.scrape(), PING, "GET", "200") - (baseline + 300)
    assert probes >= 1  # readiness checks after the restart, nothing lost before it

    send(server.url, 200)
    for _ in range(4):
        after = server.scrape()
        total = requests_total(after, PING, "GET", "200")
        assert total == baseline + 300 + probes + 200
