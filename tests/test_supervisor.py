"""Several server workers (service/cli/supervisor.py): connections spread over them, a killed
worker is replaced, a worker that cannot start stops the server. Real processes and sockets."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.cli.serve import prepare_dev_dir
from service.cli.supervisor import listening_socket
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from tests.conftest import Server, free_port, start_server, stop_server

pytestmark = pytest.mark.slow  # server workers started, killed and replaced


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("supervised"), workers=2)
    _wait_for_listeners(running, 2)
    yield running
    stop_server(running)


def _wait_for_listeners(server: Server, count: int) -> None:
    """/readyz answers as soon as one worker is up; wait for every worker's socket."""
    deadline = time.monotonic() + 60
    while len(_owners(server, {"0A"})) < count:
        assert time.monotonic() < deadline, "workers did not all start"
        time.sleep(0.1)


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _socket_inodes(port: int, states: set[str]) -> set[str]:
    """Inodes of the TCP sockets whose local port is ``port``, in the given /proc states
    (01 established, 0A listening)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in states:
                inodes.add(fields[9])
    return inodes


def _owners(server: Server, states: set[str]) -> dict[int, int]:
    """Server worker pid -> how many of its sockets on the server's port are in ``states``."""
    port = int(server.url.rsplit(":", 1)[1])
    inodes = _socket_inodes(port, states)
    counts: dict[int, int] = {}
    for pid in _children(server.process.pid):
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        owned = sum(
            link[len("socket:[") : -1] in inodes for link in links if link.startswith("socket:[")
        )
        if owned:
            counts[pid] = owned
    return counts


def test_each_worker_listens_on_its_own_socket(two_workers: Server) -> None:
    listening = _owners(two_workers, {"0A"})
    assert len(listening) == 2
    assert set(listening.values()) == {1}


def test_connections_opened_at_once_spread_over_the_workers(two_workers: Server) -> None:
    clients = [httpx.Client(base_url=two_workers.url) for _ in range(32)]
    try:
        for client in clients:  # every connection opened and kept alive
            assert client.get("/healthz").status_code == 200
        spread = _owners(two_workers, {"01"})
        # A shared socket lets the first worker awake take them all (16/0 was common); the
        # kernel's hash leaves each worker at least 4 of 32 but with probability ~1e-5.
        assert len(spread) == 2, spread
        assert min(spread.values()) >= 4, spread
    finally:
        for client in clients:
            client.close()


def test_a_killed_worker_is_replaced_and_the_service_keeps_answering(
    two_workers: Server,
) -> None:
    victim = next(iter(_owners(two_workers, {"0A"})))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        listening = _owners(two_workers, {"0A"})
        if len(listening) == 2 and victim not in listening:
            break
        assert time.monotonic() < deadline, listening
        time.sleep(0.2)
    for _ in range(10):  # fresh connections: whichever worker takes them answers
        assert httpx.get(two_workers.url + "/healthz").status_code == 200
    assert two_workers.process.poll() is None


def test_sighup_reaches_every_worker(tmp_path: Path) -> None:
    """SIGHUP to the supervisor (PID 1 in the container) makes every worker reload its
    keyring; the periodic check is switched off here so only the signal can do it."""
    server = start_server(tmp_path / "hup", {"CRYPTD_KEYRING_RELOAD_INTERVAL": "3600"}, workers=2)
    try:
        _wait_for_listeners(server, 2)
        dev = server.directory / "dev"
        master = MasterKey(base64.b64decode((dev / "master.key").read_bytes()))
        writer = KeyManager(FileKeyStore(dev / "keyring.json"), master)
        writer.load()
        # A rotation made outside the service: every worker knows the key, so nothing makes
        # it look in the store (an unknown key would), and encryptions stay on version 1.
        writer.rotate("aes256-gcm")
        body = {"plaintext": "aGk="}
        for _ in range(6):  # fresh connections, either worker: not reloaded yet
            response = server.request("POST", "/v1/encrypt/aes256-gcm", body)
            assert response.json()["key_version"] == 1
        os.kill(server.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 15
        seen = 0
        while seen < 20:  # 20 fresh connections in a row encrypt under version 2
            assert time.monotonic() < deadline, "a worker did not reload"
            response = server.request("POST", "/v1/encrypt/aes256-gcm", body)
            seen = seen + 1 if response.json()["key_version"] == 2 else 0
            time.sleep(0.05)
        assert server.process.poll() is None  # the supervisor itself carries on
    finally:
        stop_server(server)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # gone (reaped)


def test_orphans_of_a_killed_worker_are_reaped_not_left_as_zombies(tmp_path: Path) -> None:
    """A server worker SIGKILLed leaves its process-pool workers behind; they end (their
    socket closes) and, reparented to the supervisor, must not stay zombies."""
    server = start_server(
        tmp_path / "orphans",
        {"CRYPTD_EXECUTORS": '{"rsa-2048": "process"}', "CRYPTD_POOL_WORKERS": "1"},
        workers=2,
    )
    try:
        _wait_for_listeners(server, 2)
        victim = next(iter(_owners(server, {"0A"})))
        pool = _children(victim)
        assert pool, "the worker has no pool processes"
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_state(pid) is not None for pid in pool):
            states = {pid: _state(pid) for pid in pool}
            assert time.monotonic() < deadline, f"left behind: {states}"
            time.sleep(0.2)
        zombies = [pid for pid in _children(server.process.pid) if _state(pid) == "Z"]
        assert zombies == []
        assert server.request("POST", "/v1/sign/rsa-2048", {"message": "bQ=="}).status_code == 200
    finally:
        stop_server(server)


def test_a_worker_that_cannot_start_stops_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare_dev_dir sets variables
    prepare_dev_dir(tmp_path / "dev", "http://127.0.0.1:0")
    env = dict(os.environ)
    # Each worker opens the audit file; the supervisor only checks that its directory takes a
    # new file (a missing directory or a bad keyring fails earlier, in the command itself:
    # below). A symlink into a missing directory passes that look and fails in every worker.
    audit = tmp_path / "audit.log"
    audit.symlink_to(tmp_path / "missing-directory" / "audit.log")
    env["CRYPTD_AUDIT_LOG"] = str(audit)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", str(free_port()), "--workers", "2"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert time.monotonic() - started < 30
    assert b"server worker failed to start" in result.stderr


@pytest.mark.parametrize("damage", ["key removed", "wrong master key"])
def test_a_keyring_that_fails_verification_stops_the_start_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare_dev_dir sets variables
    prepare_dev_dir(tmp_path / "dev", "http://127.0.0.1:0")
    env = dict(os.environ)
    keyring = tmp_path / "dev" / "keyring.json"
    if damage == "key removed":
        document = json.loads(keyring.read_bytes())
        del document["keys"]["aes256-gcm"]
        keyring.write_text(json.dumps(document))
        expected = b"cryptd: error: keyring integrity check failed"
    else:
        other = tmp_path / "other.key"
        other.write_text(base64.b64encode(os.urandom(32)).decode())
        env["CRYPTD_MASTER_KEY_FILE"] = str(other)
        expected = b"cryptd: error: the keyring is written under master key"
    before = keyring.read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", str(free_port()), "--workers", "2"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]  # a configuration problem
    assert expected in result.stderr, result.stderr[-2000:]
    assert b"Traceback" not in result.stderr
    assert b"server worker" not in result.stderr  # refused before any worker started
    assert keyring.read_bytes() == before


def test_port_zero_or_taken_is_refused() -> None:
    with pytest.raises(ValueError, match="fixed port"):
        listening_socket("127.0.0.1", 0)
    with socket.socket() as plain:  # no SO_REUSEPORT: it keeps the group out
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError, match="in use"):
            listening_socket("127.0.0.1", plain.getsockname()[1])
    with listening_socket("127.0.0.1", free_port()) as first:  # workers join one group
        first.listen()
        with listening_socket("127.0.0.1", first.getsockname()[1]) as second:
            second.listen()
