"""Per-process figures in /metrics, correct under several workers: every live server worker
reports its own /proc figures (labelled pid) whichever worker answers the scrape, a worker
that dies disappears and its replacement appears; the served certificate's expiry and the
stores' availability are there too. Real two-worker servers for the slow tests."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.edge.tls import certificate_info
from service.metrics.process import ProcessFigures, register_process, registered_processes
from tests.conftest import Server, connections_to_every_worker, start_server, stop_server


def test_figures_of_this_process_are_read_from_proc() -> None:
    figures = ProcessFigures(os.getpid())
    assert figures.cpu_seconds is not None
    assert figures.cpu_seconds > 0
    assert figures.resident_bytes is not None
    assert figures.resident_bytes > 1024 * 1024
    assert figures.open_fds is not None
    assert figures.max_fds is not None
    assert 3 <= figures.open_fds <= figures.max_fds
    assert figures.start_time is not None
    assert figures.start_time <= time.time()
    assert figures.start_time > time.time() - 24 * 3600


def test_markers_of_dead_processes_are_dropped(tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert finished.returncode == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    register_process(tmp_path)
    register_process(tmp_path, dead.pid)
    assert registered_processes(tmp_path) == [os.getpid()]
    assert not (tmp_path / f"process_{dead.pid}").exists()
    assert ProcessFigures(dead.pid).cpu_seconds is None  # gone: nothing reported, no error


def _scrape(client: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    body = client.get("/metrics").text
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _pids(samples: dict[tuple[tuple[str, str], ...], float]) -> set[int]:
    return {int(dict(labels)["pid"]) for labels in samples}


def _worker_pids(server: Server) -> set[int]:
    children: set[int] = set()
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        children.update(int(pid) for pid in (task / "children").read_text().split())
    return {
        pid
        for pid in children
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()  # not the tracker
    }


@pytest.mark.slow
def test_every_worker_reports_each_live_worker_and_a_replacement_replaces_the_dead(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path, workers=2, tls=True)
    try:
        workers = _worker_pids(server)
        assert len(workers) == 2
        with connections_to_every_worker(server, 2) as clients:
            for client in clients.values():
                for _ in range(50):
                    client.get("/healthz")
            scrapes = [_scrape(client) for client in clients.values()]
        not_after = certificate_info(server.directory / "dev" / "tls" / "server.crt").not_after
        left = (not_after - datetime.datetime.now(datetime.UTC)).total_seconds()
        for scrape in scrapes:
            cpu = scrape["cryptd_process_cpu_seconds_total"]
            assert _pids(cpu) == workers
            assert all(value > 0 for value in cpu.values())
            assert _pids(scrape["cryptd_process_resident_memory_bytes"]) == workers
            assert min(scrape["cryptd_process_resident_memory_bytes"].values()) > 10_000_000
            fds = scrape["cryptd_process_open_fds"]
            limits = scrape["cryptd_process_max_fds"]
            assert all(0 < fds[labels] <= limits[labels] for labels in fds)
            (expiry,) = scrape["cryptd_tls_certificate_expiry_seconds"].values()
            assert abs(expiry - left) < 60
            up = scrape["cryptd_store_up"]
            assert up == {(("store", "key"),): 1.0, (("store", "replay"),): 1.0}

        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            current = _worker_pids(server)
            if len(current) == 2 and victim not in current:
                try:
                    with httpx.Client(base_url=server.url, verify=server.verify()) as client:
                        reported = _pids(_scrape(client)["cryptd_process_cpu_seconds_total"])
                except httpx.HTTPError:
                    reported = set()
                if reported == current:
                    break
            assert time.monotonic() < deadline, (current, victim)
            time.sleep(0.5)
    finally:
        stop_server(server)
