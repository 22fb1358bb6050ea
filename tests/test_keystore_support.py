"""Helpers for the key-store tests: waiting on a server's readiness, and running a server where
the disk is full or the keyring cannot be read (real mechanisms, no stand-ins)."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server, start_server, stop_server


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
