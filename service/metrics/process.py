"""Per-process CPU, memory and open files, read from ``/proc`` at scrape time.

prometheus-client's own process collector reports the process that renders the scrape, and
its multiprocess mode drops it altogether: with ``--workers N`` a scrape would describe one
worker of N, whichever answered. Here every process that records metrics (server workers and
pool workers) leaves a marker named by its pid in the multiprocess directory, and the process
that renders reads each live one's ``/proc/<pid>`` figures: one series per process, labelled
``pid``. Summing over ``pid`` gives the pod; a restarted worker is a new series, and a dead
one's marker is removed at the next scrape. In a single process the collector reports itself.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from service.metrics import definitions as names

PROC = Path("/proc")
_MARKER = re.compile(r"process_(\d+)\Z")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def register_process(directory: Path, pid: int | None = None) -> None:
    """Leave this process's marker in ``directory`` (empty file ``process_<pid>``)."""
    (directory / f"process_{pid or os.getpid()}").touch(mode=0o600)


def registered_processes(directory: Path) -> list[int]:
    """The pids with a marker whose process is alive; markers of dead ones are removed."""
    found = []
    for entry in directory.iterdir():
        match = _MARKER.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if (PROC / str(pid)).exists() or pid == os.getpid():
            found.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return sorted(found)


class ProcessFigures:
    """One process's figures (None where ``/proc`` could not be read)."""

    __slots__ = ("cpu_seconds", "max_fds", "open_fds", "resident_bytes", "start_time")

    def __init__(self, pid: int) -> None:
        self.cpu_seconds: float | None = None
        self.start_time: float | None = None
        self.resident_bytes: float | None = None
        self.open_fds: float | None = None
        self.max_fds: float | None = None
        base = PROC / str(pid)
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Fields after the command name, which may hold spaces and parentheses.
            fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
            self.cpu_seconds = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
            self.resident_bytes = float(int(fields[21]) * _PAGE_SIZE)
            self.start_time = _boot_time() + int(fields[19]) / _CLOCK_TICKS
        with contextlib.suppress(OSError):
            self.open_fds = float(len(os.listdir(base / "fd")))
        with contextlib.suppress(OSError, ValueError):
            for line in (base / "limits").read_text().splitlines():
                if line.startswith("Max open files"):
                    self.max_fds = float(line.split()[3])


def _boot_time() -> float:
    for line in (PROC / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")


class ProcessCollector:
    """Yields the figures of every process ``pids()`` names, labelled ``pid``."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self._pids = pids

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            names.PROCESS_CPU,
            "User and system CPU time of each cryptd process (server and pool workers).",
            labels=["pid"],
        )
        resident = GaugeMetricFamily(
            names.PROCESS_RESIDENT_MEMORY,
            "Resident memory of each cryptd process, in bytes.",
            labels=["pid"],
        )
        open_fds = GaugeMetricFamily(
            names.PROCESS_OPEN_FDS, "Open file descriptors of each cryptd process.", labels=["pid"]
        )
        max_fds = GaugeMetricFamily(
            names.PROCESS_MAX_FDS,
            "Limit of open file descriptors of each cryptd process.",
            labels=["pid"],
        )
        start = GaugeMetricFamily(
            names.PROCESS_START_TIME,
            "Start time of each cryptd process, in seconds since the epoch.",
            labels=["pid"],
        )
        pairs = (
            (cpu, "cpu_seconds"),
            (resident, "resident_bytes"),
            (open_fds, "open_fds"),
            (max_fds, "max_fds"),
            (start, "start_time"),
        )
        for pid in self._pids():
            figures = ProcessFigures(pid)
            for family, attribute in pairs:
                value = getattr(figures, attribute)
                if value is not None:
                    family.add_metric([str(pid)], value)
        yield from (family for family, _ in pairs)
