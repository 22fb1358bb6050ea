"""CPU time of a process tree from /proc (Linux): what a server spent during a measurement,
its worker processes and pool processes included; and the peak resident memory of a child."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or not Linux
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def _children(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parents[int(entry)] = int(fields[1])
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def tree_cpu_seconds(root: int | Sequence[int]) -> float:
    """User + system CPU seconds of ``root`` (one pid or several) and their live descendants
    (threads included)."""
    roots = [root] if isinstance(root, int) else list(root)
    pids: set[int] = set()
    for one in roots:
        pids |= _children(one)
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            # utime and stime are fields 14 and 15 of /proc/PID/stat (1-based): 11, 12 here.
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def process_cpu_seconds(root: int) -> dict[int, float]:
    """User + system CPU seconds of ``root`` and each live descendant, by pid (threads counted
    with their process): how a server's work spreads over its workers."""
    found = {}
    for pid in _children(root):
        fields = _stat_fields(pid)
        if fields is not None:
            found[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    return found


def _peak_rss_kib(pid: int) -> int | None:
    """VmHWM of ``pid``: the peak resident set of the program it runs now (since its exec)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None  # a zombie: no memory left to tell


class PeakRss:
    """The peak RSS of a child process, polled from /proc while it runs. wait4()'s
    ru_maxrss cannot tell it: a child started by fork (or vfork) and exec keeps the larger of its
    own peak and its parent's at the exec, so a parent holding a big table shows as the child."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self._pid = pid
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.kib = 0

    def _poll(self) -> None:
        while True:
            peak = _peak_rss_kib(self._pid)
            if peak is not None:
                self.kib = max(self.kib, peak)
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mib(self) -> float | None:
        return self.kib / 1024 if self.kib else None


def system_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(values) - values[3] - values[4]) / _TICKS


@dataclass
class CpuUsage:
    """CPU seconds spent during a measurement window."""

    server: float | None  # the server process tree
    client: float  # the load generator
    others: float  # everything else on the machine (other users of the shared cores)


class CpuWindow:
    """Context manager measuring :class:`CpuUsage`. The load generator is either a child
    process reaped inside the window (``client="children"``, e.g. wrk) or this process
    (``client="self"``, the open-loop generator)."""

    def __init__(
        self, server_pid: int | Sequence[int] | None, client: Literal["children", "self"]
    ) -> None:
        self.server_pid = server_pid
        self.who = resource.RUSAGE_CHILDREN if client == "children" else resource.RUSAGE_SELF
        self.usage: CpuUsage | None = None

    def _client(self) -> float:
        usage = resource.getrusage(self.who)
        return usage.ru_utime + usage.ru_stime

    def __enter__(self) -> CpuWindow:
        self._server = tree_cpu_seconds(self.server_pid) if self.server_pid else None
        self._client0 = self._client()
        self._busy = system_busy_seconds()
        return self

    def __exit__(self, *_exc: object) -> None:
        busy = system_busy_seconds() - self._busy
        client = self._client() - self._client0
        server = None
        if self.server_pid and self._server is not None:
            # Outside the load the server idles: the whole window is the load's cost.
            server = tree_cpu_seconds(self.server_pid) - self._server
        others = max(0.0, busy - client - (server or 0.0))
        self.usage = CpuUsage(server, client, others)


def others_load(sample: float = 0.5) -> float:
    """Cores busy over ``sample`` seconds (call it while the servers under test idle)."""
    before = system_busy_seconds()
    time.sleep(sample)
    return (system_busy_seconds() - before) / sample


def wait_for_quiet(threshold: float, max_wait: float, on_wait: Callable[[float], None]) -> float:
    """Wait (up to ``max_wait`` s) until the rest of the machine uses at most ``threshold``
    cores: the cores are shared, and a neighbour's burst would land in one target's figures.
    Returns the last load seen; ``on_wait(load)`` is called once when waiting starts."""
    deadline = time.monotonic() + max_wait
    announced = False
    while True:
        load = others_load()
        if load <= threshold or time.monotonic() >= deadline:
            return load
        if not announced:
            on_wait(load)
            announced = True
        time.sleep(1.0)
