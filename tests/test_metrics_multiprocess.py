"""Multiprocess mode with real processes writing to one directory: merged counts, merged
quantile sketches, worker death, fork and pickling into a process pool."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import init_multiprocess_dir, mark_worker_dead, render_directory
from service.metrics.window import RELATIVE_ACCURACY

pytestmark = pytest.mark.slow  # several processes

ROOT = Path(__file__).resolve().parents[1]

# A worker process: records what it is told, publishes, then exits, hangs (to be killed) or
# forks a child that records more.
CHILD = """
import json, os, sys, time
from pathlib import Path
from service.metrics import Metrics

plan = json.loads(sys.argv[1])
metrics = Metrics(multiprocess_dir=Path(plan["dir"]))

def record(part):
    for route, method, status, seconds in part.get("requests", []):
        metrics.observe_request(route, method, status, seconds)
    for operation, key_type, seconds, outcome, items in part.get("crypto", []):
        metrics.observe_crypto(operation, key_type, seconds, outcome, items)
    if part.get("pool"):
        metrics.pool_gauges(*part["pool"])

record(plan)
if plan.get("fork"):
    pid = os.fork()
    if pid == 0:
        record(plan["fork"])
        metrics.close()
        os._exit(0)
    os.waitpid(pid, 0)
if plan.get("hang"):
    metrics.render()  # publishes this process's window now
    print("ready", flush=True)
    time.sleep(600)
metrics.close()
"""

POOL_DRIVER = """
import json, sys
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from service.metrics import Metrics

plan = json.loads(sys.argv[1])
metrics = Metrics(multiprocess_dir=Path(plan["dir"]))
context = multiprocessing.get_context("spawn")
with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
    futures = [
        pool.submit(metrics.observe_crypto, "sign", "rsa-2048", seconds, "ok", 1)
        for seconds in plan["seconds"]
    ]
    for future in futures:
        future.result()
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(directory: Path) -> Samples:
    body, _ = render_directory(directory)
    found: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def child_env() -> dict[str, str]:
    env = {key: v for key, v in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def run(code: str, plan: dict[str, Any]) -> None:
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(plan)], env=child_env(), check=True, timeout=120
    )


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "metrics"
    saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    init_multiprocess_dir(path)
    yield path
    # init_multiprocess_dir exports the variable for workers; this test process is no worker.
    if saved is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved


class Hanging:
    """A worker process that recorded its share and now waits to be killed."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps({**plan, "hang": True})],
            env=child_env(),
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == b"ready\n"

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        self.process.stdout.close()


def exact_quantile(values: list[float], q: float) -> float:
    return sorted(values)[math.floor(q * (len(values) - 1))]


ROUTE = "/v1/encrypt/{key}"


def test_two_processes_merge_into_exact_counts_and_sketch_quantiles(directory: Path) -> None:
    rng = random.Random(6)
    fast = [rng.uniform(0.0002, 0.002) for _ in range(300)]
    slow = [rng.uniform(0.005, 0.08) for _ in range(100)]
    run(CHILD, {"dir": str(directory), "requests": [[ROUTE, "POST", 200, s] for s in fast],
                "crypto": [["sign", "rsa-2048", 0.064, "ok", 64]]})  # fmt: skip
    run(CHILD, {"dir": str(directory), "requests": [[ROUTE, "POST", 200, s] for s in slow],
                "crypto": [["sign", "rsa-2048", 0.004, "ok", 1]]})  # fmt: skip

    found = scrape(directory)
    labels = {"route": ROUTE, "method": "POST", "status": "200"}
    assert value(found, "cryptd_http_requests_total", **labels) == 400
    assert value(found, "cryptd_http_request_duration_seconds_count", **labels) == 400
    assert value(found, "cryptd_http_request_duration_seconds_sum", **labels) == pytest.approx(
        sum(fast) + sum(slow)
    )
    union = fast + slow
    window = {"route": ROUTE, "method": "POST"}
    assert value(found, "cryptd_http_request_window_observations", **window) == 400
    for q in (0.5, 0.99):
        gauge = value(found, "cryptd_http_request_duration_window_seconds", quantile=repr(q),
                      **window)  # fmt: skip
        exact = exact_quantile(union, q)
        assert abs(gauge - exact) <= RELATIVE_ACCURACY * exact, q
    # The mean of the two processes' medians is nowhere near the service's median.
    p50 = value(found, "cryptd_http_request_duration_window_seconds", quantile="0.5", **window)
    assert p50 < (exact_quantile(fast, 0.5) + exact_quantile(slow, 0.5)) / 2 / 2
    crypto = {"operation": "sign", "key_type": "rsa-2048"}
    histogram = {**crypto, "outcome": "ok"}
    assert value(found, "cryptd_crypto_operation_duration_seconds_count", **histogram) == 65
    assert value(found, "cryptd_crypto_operations_total", outcome="ok", **crypto) == 65
    assert value(found, "cryptd_crypto_operation_window_observations", **crypto) == 65
    # 64 items at 1 ms each (one batch of 64 in 64 ms) and one at 4 ms.
    p50 = value(found, "cryptd_crypto_operation_duration_window_seconds", quantile="0.5", **crypto)
    assert abs(p50 - 0.001) <= RELATIVE_ACCURACY * 0.001


def test_dead_worker_leaves_no_double_count_and_counters_stay_monotonic(directory: Path) -> None:
    requests = [[ROUTE, "POST", 200, 0.001]]
    first = Hanging({"dir": str(directory), "requests": requests * 50, "pool": [5, 3]})
    before = scrape(directory)
    labels = {"route": ROUTE, "method": "POST", "status": "200"}
    assert value(before, "cryptd_http_requests_total", **labels) == 50
    assert value(before, "cryptd_pool_queued", executor="process") == 5

    first.kill()  # no cleanup of its own, as after an OOM kill
    after_death = scrape(directory)
    assert value(after_death, "cryptd_http_requests_total", **labels) == 50
    assert ("cryptd_pool_queued", frozenset({("executor", "process")})) not in after_death
    pid = first.process.pid
    assert (directory / f"histogram_{pid}.db").exists()
    assert not (directory / f"gauge_livesum_{pid}.db").exists()

    second = Hanging({"dir": str(directory), "requests": requests * 20, "pool": [2, 1]})
    try:
        found = scrape(directory)
        assert value(found, "cryptd_http_requests_total", **labels) == 70
        assert value(found, "cryptd_http_request_duration_seconds_count", **labels) == 70
        assert value(found, "cryptd_pool_queued", executor="process") == 2
        assert value(found, "cryptd_pool_in_flight", executor="process") == 1
        # The dead worker's recent latencies still belong to the window.
        window = {"route": ROUTE, "method": "POST"}
        assert value(found, "cryptd_http_request_window_observations", **window) == 70
    finally:
        second.kill()
    mark_worker_dead(second.process.pid, directory)
    assert not (directory / f"gauge_livesum_{second.process.pid}.db").exists()
    final = scrape(directory)
    assert value(final, "cryptd_http_requests_total", **labels) == 70


def test_forked_child_does_not_republish_its_parents_observations(directory: Path) -> None:
    parent = [[ROUTE, "POST", 200, 0.001]] * 30
    child = [[ROUTE, "POST", 200, 0.003]] * 10
    run(CHILD, {"dir": str(directory), "requests": parent, "fork": {"requests": child}})
    found = scrape(directory)
    labels = {"route": ROUTE, "method": "POST", "status": "200"}
    assert value(found, "cryptd_http_requests_total", **labels) == 40
    window = {"route": ROUTE, "method": "POST"}
    assert value(found, "cryptd_http_request_window_observations", **window) == 40
    sketch_files = sorted(p.name for p in directory.glob("window_*.json"))
    assert len(sketch_files) == 2


def test_pickled_metrics_record_inside_process_pool_workers(directory: Path) -> None:
    seconds = [0.001 * (1 + i % 5) for i in range(40)]
    run(POOL_DRIVER, {"dir": str(directory), "seconds": seconds})
    found = scrape(directory)
    crypto = {"operation": "sign", "key_type": "rsa-2048"}
    assert value(found, "cryptd_crypto_operations_total", outcome="ok", **crypto) == 40
    histogram = {**crypto, "outcome": "ok"}
    assert value(found, "cryptd_crypto_operation_duration_seconds_sum", **histogram) == (
        pytest.approx(sum(seconds))
    )
    # Pool workers publish their window when they exit normally.
    assert value(found, "cryptd_crypto_operation_window_observations", **crypto) == 40
    p50 = value(found, "cryptd_crypto_operation_duration_window_seconds", quantile="0.5", **crypto)
    assert abs(p50 - 0.003) <= RELATIVE_ACCURACY * 0.003


def test_init_removes_a_previous_runs_metric_files_only(tmp_path: Path) -> None:
    path = tmp_path / "reused"
    path.mkdir()
    stale = ["counter_123.db", "histogram_123.db", "gauge_livesum_123.db", "window_123.json",
             ".window_123.tmp"]  # fmt: skip
    for name in stale:
        (path / name).write_bytes(b"x")
    (path / "notes.txt").write_text("keep me")
    saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    try:
        init_multiprocess_dir(path)
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(path)
    finally:
        if saved is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved
    assert sorted(p.name for p in path.iterdir()) == ["notes.txt"]
    fresh = tmp_path / "fresh" / "metrics"
    init_multiprocess_dir(fresh)
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if saved is not None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved
    assert fresh.is_dir()
    assert fresh.stat().st_mode & 0o777 == 0o700


def test_one_process_writes_to_one_directory_only(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    code = """
import sys
from pathlib import Path
from service.metrics import Metrics
Metrics(multiprocess_dir=Path(sys.argv[1]))
Metrics(multiprocess_dir=Path(sys.argv[1]))  # the same directory again is fine
try:
    Metrics(multiprocess_dir=Path(sys.argv[2]))
except ValueError as exc:
    print("refused:", exc)
"""
    result = subprocess.run(
        [sys.executable, "-c", code, str(first), str(second)],
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "refused: this process already writes metrics to another directory" in result.stdout
