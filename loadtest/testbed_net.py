"""The test bed's network: one Linux network namespace per machine, each joined by a veth pair
to one bridge in the root namespace (where the load generator runs), one address each.

Everything is named after a prefix (``cbed`` by default), so that ``down`` finds and removes
what a crashed run left behind without any state file: the namespaces ``<prefix>-<role>``, the
bridge ``<prefix>br`` and the veth ends ``<prefix><n>``. Needs root and iproute2."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Inside every namespace the bed's interface has this name.
INNER_IF = "eth0"


class BedError(RuntimeError):
    """The bed cannot do what was asked (a missing program, a process that would not start)."""


def need(program: str) -> str:
    """The path of ``program``; a missing one is an error, never a silent skip."""
    path = shutil.which(program)
    if path is None:
        raise BedError(f"{program} is not installed (the bed needs it)")
    return path


def run(command: Sequence[str], *, check: bool = True, timeout: float = 60) -> str:
    """Run ``command`` and return its output; a failure raises with its stderr."""
    result = subprocess.run(
        list(command), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise BedError(f"{' '.join(command)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


@dataclass(frozen=True)
class Node:
    """One machine of the bed: a namespace with one address on the bridge."""

    role: str  # app1, pg1, redis1, sentinel1, lb, ...
    index: int  # the last byte of its address; also names its veth end
    prefix: str
    subnet: str  # the first three bytes: "10.231.0"

    @property
    def namespace(self) -> str:
        return f"{self.prefix}-{self.role}"

    @property
    def address(self) -> str:
        return f"{self.subnet}.{self.index}"

    @property
    def veth(self) -> str:
        return f"{self.prefix}{self.index}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this machine's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:
        """Every process living in this machine's namespace."""
        if self.namespace not in namespaces(self.prefix):
            return []
        text = run(["ip", "netns", "pids", self.namespace], check=False)
        return [int(p) for p in text.split()]

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL every process of the machine (a power cut); returns how many there were."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                raise BedError(f"{self.role}: processes survived SIGKILL: {self.pids()}")
            time.sleep(0.05)
        return len(pids)

    def link(self, up: bool) -> None:
        """Bring the machine's only link down (cut off from every other machine) or up."""
        state = "up" if up else "down"
        run(self.command(["ip", "link", "set", INNER_IF, state]))


def bridge_name(prefix: str) -> str:
    return f"{prefix}br"


def namespaces(prefix: str) -> list[str]:
    """The bed's namespaces that exist now."""
    text = run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in text.splitlines() if line.strip()]
    return [name for name in names if name.startswith(f"{prefix}-")]


def create_bridge(prefix: str, subnet: str) -> None:
    bridge = bridge_name(prefix)
    run(["ip", "link", "add", bridge, "type", "bridge"])
    run(["ip", "addr", "add", f"{subnet}.1/24", "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])


def create_node(node: Node) -> None:
    """The namespace, its veth pair on the bridge, its address, loopback up."""
    run(["ip", "netns", "add", node.namespace])
    # The inner end is made inside the namespace: the root namespace may have an eth0 too.
    peer = ["peer", "name", INNER_IF, "netns", node.namespace]
    run(["ip", "link", "add", node.veth, "type", "veth", *peer])
    run(["ip", "link", "set", node.veth, "master", bridge_name(node.prefix), "up"])
    run(node.command(["ip", "addr", "add", f"{node.address}/24", "dev", INNER_IF]))
    run(node.command(["ip", "link", "set", INNER_IF, "up"]))
    run(node.command(["ip", "link", "set", "lo", "up"]))


def destroy_network(prefix: str) -> list[str]:
    """Kill every process in the bed's namespaces, delete them, the bridge and any veth end
    left over. Safe to run again and after a crash; returns what it removed."""
    removed: list[str] = []
    for name in namespaces(prefix):
        text = run(["ip", "netns", "pids", name], check=False)
        for pid in (int(p) for p in text.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while run(["ip", "netns", "pids", name], check=False).split():
            if time.monotonic() > deadline:
                raise BedError(f"{name}: processes survived SIGKILL")
            time.sleep(0.05)
        run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    links = run(["ip", "-o", "link", "show"], check=False)
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == bridge_name(prefix) or (
            name.startswith(prefix) and name[len(prefix) :].isdigit()
        ):
            run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below ``directory`` (deepest first)."""
    root = str(directory.resolve())
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == root or point.startswith(root + "/"):
            found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)
