"""Private Redis topologies for the high-availability tests: a primary with a replica watched
by three Sentinels, and a three-node Redis Cluster, each on free ports in a temporary
directory, with no persistence. Skipped where the programs are missing, except under CI."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import free_port

MASTER = "cryptd-primary"


def require_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required under CI (Debian: redis-server, redis-sentinel)")
        pytest.skip(f"{name} is not installed")
    return path


def wait_until(what: str, ready: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


_CLIENTS: dict[int, redis.Redis] = {}


def client(port: int) -> redis.Redis:
    """A client of the server on ``port``, kept until :func:`close_clients` (it reconnects by
    itself after a restart)."""
    if port not in _CLIENTS:
        _CLIENTS[port] = redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1
        )
    return _CLIENTS[port]


def command(port: int, *args: str) -> Any:
    """One command, its reply (redis-py leaves ``execute_command`` untyped)."""
    untyped: Any = client(port)
    return untyped.execute_command(*args)


def close_clients(ports: list[int]) -> None:
    for port in ports:
        if (kept := _CLIENTS.pop(port, None)) is not None:
            kept.close()


class RedisProcess:
    """One redis-server (or Sentinel) on ``port``; ``kill()`` is SIGKILL, nothing saved."""

    def __init__(self, directory: Path, port: int, args: list[str]) -> None:
        self.port = port
        self.directory = directory
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.args, cwd=self.directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        process = self.process

        def up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"{self.args[0]} on port {self.port} exited")
            return bool(client(self.port).ping())

        wait_until(f"redis on port {self.port}", up)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


def redis_server(directory: Path, port: int, *extra: str) -> RedisProcess:
    binary = require_program("redis-server")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    return RedisProcess(directory, port, [*args, "no", "--dir", str(directory), *extra])


class SentinelSetup:
    """A primary, one replica and three Sentinels (quorum 2, down after 1 s)."""

    def __init__(self, base: Path) -> None:
        require_program("redis-sentinel")
        self.primary = redis_server(base / "primary", free_port())
        self.replica = redis_server(
            base / "replica", free_port(), "--replicaof", "127.0.0.1", str(self.primary.port)
        )
        self.sentinels = [self._sentinel(base / f"sentinel{i}") for i in range(3)]

    def _sentinel(self, directory: Path) -> RedisProcess:
        port = free_port()
        directory.mkdir(parents=True)
        config = directory / "sentinel.conf"
        config.write_text(
            f"port {port}\nbind 127.0.0.1\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 6000\n"
        )
        return RedisProcess(directory, port, [require_program("redis-sentinel"), str(config)])

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def master_port(self) -> int:
        reply = command(self.sentinels[0].port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        return int(reply[1])

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        self.wait_replica_synced(self.primary.port)
        for sentinel in self.sentinels:
            sentinel.start()

        def sentinels_ready() -> bool:
            for sentinel in self.sentinels:
                others = command(sentinel.port, "SENTINEL", "SENTINELS", MASTER)
                replicas = command(sentinel.port, "SENTINEL", "REPLICAS", MASTER)
                if len(others) < 2 or not replicas:
                    return False
            return True

        wait_until("the Sentinels to know each other and the replica", sentinels_ready, 30)

    def wait_replica_synced(self, primary_port: int) -> None:
        def synced() -> bool:
            info = client(primary_port).info("replication")
            return int(info.get("connected_slaves", 0)) > 0 and all(
                info[k]["state"] == "online" for k in info if str(k).startswith("slave")
            )

        wait_until("the replica to synchronise", synced)

    def stop(self) -> None:
        processes = (*self.sentinels, self.replica, self.primary)
        for process in processes:
            process.kill()
        close_clients([process.port for process in processes])


@contextlib.contextmanager
def sentinel_setup(base: Path) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(base)
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


def cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10,000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class ClusterSetup:
    """Three primaries, no replicas, every slot assigned (``redis-cli --cluster create``)."""

    def __init__(self, base: Path) -> None:
        self.nodes = [
            redis_server(
                base / f"node{i}",
                cluster_port(),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            )
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port},127.0.0.1:{self.nodes[1].port}?cluster=true"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                require_program("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        wait_until(
            "the cluster to serve every slot",
            lambda: all(
                command(n.port, "CLUSTER", "INFO").decode().count("cluster_state:ok")
                for n in self.nodes
            ),
            30,
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        close_clients([node.port for node in self.nodes])


@contextlib.contextmanager
def cluster_setup(base: Path) -> Iterator[ClusterSetup]:
    setup = ClusterSetup(base)
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()
