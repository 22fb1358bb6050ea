"""Logging in every server worker: with two workers (spawned processes) each request gives
exactly one structured access line when the access log is on and none when it is off (never
uvicorn's plain-text one), and every worker writes its start lines. Real servers over TLS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import connections_to_every_worker, start_server, stop_server

pytestmark = pytest.mark.slow  # live servers of two workers

WORKERS = 2
PER_WORKER = 25
WORKER_START_LINES = (
    "TLS certificate loaded",
    "keyring loaded",
    "Application startup complete.",
    "cryptd listening on https://",
)


def _records(log: str) -> list[dict[str, Any]]:
    """The JSON lines of a server's output (the development bootstrap also prints plain
    ``cryptd: ...`` lines, which are not log records)."""
    found = []
    for line in log.splitlines():
        if line.startswith("{"):
            found.append(orjson.loads(line))
        else:
            assert line.startswith("cryptd: "), line
    return found


@pytest.mark.parametrize("access_log", [True, False])
def test_two_workers_log_one_structured_line_per_request_and_every_start_line(
    tmp_path: Path, access_log: bool
) -> None:
    env = {"CRYPTD_ACCESS_LOG": "true" if access_log else "false"}
    server = start_server(tmp_path, env, workers=WORKERS, tls=True)
    try:
        with connections_to_every_worker(server, WORKERS) as clients:
            pids = set()
            for client in clients.values():
                for _ in range(PER_WORKER):
                    assert client.get("/healthz").status_code == 200
                pids.add(client.get("/readyz").json()["checks"]["server"]["worker"])
            assert pids == set(range(WORKERS))
    finally:
        stop_server(server)
    records = _records(server.log())
    assert not [r for r in records if r["logger"] == "uvicorn.access"]
    assert not [r for r in records if "GET /healthz" in r["msg"]]
    access = [r for r in records if r["logger"] == "cryptd.access"]
    healthz = [r for r in access if r["route"] == "/healthz"]
    assert len(healthz) == (WORKERS * PER_WORKER if access_log else 0)
    assert all(r["msg"] == "request" and r["status"] == 200 for r in healthz)
    if not access_log:
        assert access == []
    for start_line in WORKER_START_LINES:
        found = [r for r in records if r["msg"].startswith(start_line)]
        assert len(found) == WORKERS, (start_line, found)
    (starting,) = [r for r in records if r["msg"] == "cryptd starting"]
    assert starting["mode"] == "development"
    assert starting["workers"] == WORKERS
    assert starting["tls_subject"] == "CN=cryptd development server"
    assert starting["replay_store"].startswith("host directory ")
    tls = [r for r in records if r["msg"] == "TLS certificate loaded"]
    assert all(r["subject"] == "CN=cryptd development server" for r in tls)
    keyring_pids = {r["pid"] for r in records if r["msg"] == "keyring loaded"}
    assert len(keyring_pids) == WORKERS
    assert server.process.pid not in keyring_pids
