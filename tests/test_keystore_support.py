"""Helpers for the key-store tests: waiting on a server's readiness, and running a server where
the disk is full or the keyring cannot be read (real mechanisms, no stand-ins)."""

from __future__ import annotations

import base64
import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.keys.masterkey import MasterKey
from service.keys.pgstore import PostgresKeyStore
from tests.conftest import Server, free_port, start_server, stop_server


# Fixtures for the PostgreSQL store tests, imported there under these names (pytest finds a
# fixture by its ``name``; the function names keep the importing module's lint quiet).
@pytest.fixture(name="master")
def master_key_fixture() -> MasterKey:
    return MasterKey(os.urandom(32))


_opened: list[PostgresKeyStore] = []


@pytest.fixture(name="close_stores", autouse=True)
def close_stores_fixture() -> Iterator[None]:
    """Every store a test opened with :func:`open_store` is closed after it (an unclosed
    connection is a warning). Autouse where a test module imports it."""
    yield
    while _opened:
        _opened.pop().close()


def open_store(url: str) -> PostgresKeyStore:
    store = PostgresKeyStore(url)
    _opened.append(store)
    return store


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def keyring_check(server: Server) -> dict[str, Any]:
    check: dict[str, Any] = server.request("GET", "/readyz").json()["checks"]["keyring"]
    return check


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def needs_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def needs_root(why: str) -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"needs root: {why}")
        pytest.skip(f"needs root: {why}")


@contextlib.contextmanager
def server_on_small_tmpfs(directory: Path, size: str = "4m") -> Iterator[tuple[Server, Path]]:
    """A development server whose state lives on its own tmpfs of ``size``, mounted in a
    private mount namespace (nothing leaks into the host's mounts). Yields the server and the
    directory as this process sees it (through ``/proc/<pid>/root``)."""
    needs_root("mounting a tmpfs in a private mount namespace")
    unshare = needs_tool("unshare")
    mount_point = directory / "small-disk"
    mount_point.mkdir(parents=True)
    prefix = [
        unshare,
        "--mount",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        'mount -t tmpfs -o size="$0",mode=0700 tmpfs "$1" && shift && exec "$@"',
        size,
        str(mount_point),
    ]

    def view(pid: int) -> Path:
        return Path(f"/proc/{pid}/root") / mount_point.relative_to("/") / "dev"

    server = start_server(
        directory,
        {"CRYPTD_DEV_DIR": str(mount_point / "dev")},
        prefix=prefix,
        state_view=view,
    )
    try:
        yield server, view(server.process.pid)
    finally:
        stop_server(server)


def fill(directory: Path) -> Path:
    """Fill the filesystem holding ``directory`` until it reports ENOSPC; returns the filler."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for size in (65536, 4096, 512, 1):  # whatever fits in smaller pieces too
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError:
                continue
    return filler


def without_file_access_override() -> list[str]:
    """A command prefix under which even root cannot read a file it has no permission bits
    for: the capabilities that bypass file permissions leave the bounding set."""
    if os.geteuid() != 0:
        return []
    setpriv = needs_tool("setpriv")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


def start_replicas(
    directory: Path,
    keystore_url: str | Sequence[str],
    *,
    count: int = 2,
    workers: int = 2,
    env: dict[str, str] | None = None,
) -> list[Server]:
    """``count`` development servers of ``workers`` workers each on one PostgreSQL key store:
    the first creates the development state (master key, client, keys), the others get a
    copy of its directory, as replicas share one master key and one clients file. Several
    URLs: one replica each (the same database reached by different paths)."""
    urls = [keystore_url] * count if isinstance(keystore_url, str) else list(keystore_url)

    def settings(index: int) -> dict[str, str]:
        return {"CRYPTD_KEYSTORE_URL": urls[index], **(env or {})}

    servers = [start_server(directory / "replica-0", settings(0), workers=workers)]
    try:
        for index in range(1, len(urls)):
            state = directory / f"replica-{index}" / "dev"
            state.mkdir(parents=True)
            for name in ("master.key", "clients.json"):
                shutil.copy2(directory / "replica-0" / "dev" / name, state / name)
            servers.append(
                start_server(directory / f"replica-{index}", settings(index), workers=workers)
            )
    except BaseException:
        for server in servers:
            stop_server(server)
        raise
    return servers


@contextlib.contextmanager
def replicas(
    directory: Path, keystore_url: str | Sequence[str], **options: Any
) -> Iterator[list[Server]]:
    servers = start_replicas(directory, keystore_url, **options)
    try:
        yield servers
    finally:
        for server in servers:
            stop_server(server)


PG_BIN = Path("/usr/lib/postgresql/15/bin")


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster of one test's own, on a free port: stopping it disturbs nobody."""

    directory: Path
    port: int
    settings: tuple[str, ...] = ()  # more `-c name=value` options

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [*_as_postgres(), str(PG_BIN / "pg_ctl"), "-D", str(self.directory / "data"), *args],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off "
            f"-c unix_socket_directories={self.directory}"
            + "".join(f" -c {setting}" for setting in self.settings)
        )
        self._pg_ctl("-o", options, "-l", str(self.directory / "log"), "-w", "start")

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "-w", "stop")


def _as_postgres() -> list[str]:
    if os.geteuid() == 0:
        return [needs_tool("runuser"), "-u", "postgres", "--"]
    return []


@contextlib.contextmanager
def private_postgres(tls: tuple[bytes, bytes] | None = None) -> Iterator[PrivatePostgres]:
    """A private cluster (trust authentication). ``tls``: (certificate chain, key) PEM; the
    cluster then accepts TCP connections over TLS only (hostssl), so a client that connects
    at all spoke TLS."""
    if not (PG_BIN / "initdb").exists():
        message = f"{PG_BIN}/initdb is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
        needs_root("running a private PostgreSQL cluster as the postgres user")
    directory = Path(tempfile.mkdtemp(prefix="cryptd-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    cluster = PrivatePostgres(directory, free_port())
    try:
        subprocess.run(
            [
                *_as_postgres(),
                str(PG_BIN / "initdb"),
                "-D",
                str(directory / "data"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        if tls is not None:
            data = directory / "data"
            for name, content in (("server.crt", tls[0]), ("server.key", tls[1])):
                (data / name).write_bytes(content)
                (data / name).chmod(0o600)
                if os.geteuid() == 0:
                    shutil.chown(data / name, "postgres", "postgres")
            (data / "pg_hba.conf").write_text(
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n"
            )
            cluster.settings = ("ssl=on",)
        cluster.start()
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
