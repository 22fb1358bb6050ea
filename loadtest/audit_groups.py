"""How the audit trail groups its records under load: ``python -m loadtest.audit_groups``.

One ``cryptd serve --dev`` server (one worker, the audit file fail-closed as
``loadtest.audit_cost`` runs it) on the server CPUs of the pinned topology; wrk drives signed
``aes-encrypt`` requests at it while ``perf record`` traces the worker's ``write`` calls and the
sync processes' ``fdatasync`` calls (kernel tracepoints: counts, never the data). Printed: the
requests per second, the server's CPU per request (its process tree, sync processes included,
from ``/proc``) and theirs alone, the groups written (one ``write`` each to the audit file), the
syncs, and the distribution of records per group (each write's size over the median record
line's). A same-run A/B says which version is faster; this says why (groups of one record cost
one sync each).

Needs ``perf`` with the ``syscalls`` tracepoints (root, or ``perf_event_paranoid`` <= -1).
Run it on a quiet machine: group sizes follow the load.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.audit_cost import audit_env
from loadtest.measure import run_wrk
from loadtest.plan import make_topology
from loadtest.procstat import tree_cpu_seconds
from loadtest.targets import Cryptd

TRACEPOINTS = ("-e", "syscalls:sys_enter_write", "-e", "syscalls:sys_enter_fdatasync")


@dataclass
class Groups:
    requests: int
    seconds: float
    server_cpu_s: float
    sync_cpu_s: float
    syncs: int
    sizes: dict[int, int]  # records per group -> groups

    @property
    def groups(self) -> int:
        return sum(self.sizes.values())

    def summary(self) -> str:
        groups = self.groups or 1
        mean = sum(k * v for k, v in self.sizes.items()) / groups
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(self.sizes.items())[:16])
        per = 1e6 / max(1, self.requests)
        return (
            f"{self.requests / self.seconds:,.0f} requests/s; CPU per request"
            f" {self.server_cpu_s * per:.0f} us (sync processes {self.sync_cpu_s * per:.0f} us);"
            f" {self.groups} groups, {self.syncs} fdatasync"
            f" ({self.syncs / max(1, self.requests):.2f} per request);"
            f" records per group: mean {mean:.2f}, {{{shown}}}"
        )


def children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found += [int(name), *children(int(name))]
    return found


def sync_processes(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        try:
            if b"barrier.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def group_sizes(script: str, record_bytes: int) -> tuple[dict[int, int], int]:
    """From ``perf script``'s lines: records per group (the audit file's writes: the file
    descriptor written to most often with writes of a record's size or more) and syncs."""
    writes: list[tuple[int, int]] = []
    syncs = 0
    for line in script.splitlines():
        if "sys_enter_fdatasync" in line:
            syncs += 1
        elif "sys_enter_write:" in line and "fd: " in line:
            fd = int(line.split("fd: ")[1].split(",")[0], 16)
            count = int(line.split("count: ")[1].split(",")[0].split()[0], 16)
            writes.append((fd, count))
    big = collections.Counter(fd for fd, count in writes if count >= record_bytes * 0.9)
    if not big:
        return {}, syncs
    audit_fd = big.most_common(1)[0][0]
    sizes = collections.Counter(
        max(1, round(count / record_bytes)) for fd, count in writes if fd == audit_fd
    )
    return dict(sizes), syncs


def median_record(directory: Path) -> int:
    lines = [
        len(line) + 1
        for path in directory.iterdir()
        if path.name.startswith("audit.log")
        for line in path.read_bytes().splitlines()
        if b'"event":"encrypt"' in line
    ]
    return int(statistics.median(lines)) if lines else 300


def measure(args: argparse.Namespace, env: dict[str, str], work: Path) -> Groups:
    topology = make_topology(args)
    connections, duration = args.connections, args.duration
    audit_dir = work / "audit"
    audit_dir.mkdir()
    server = Cryptd(work / "server", env={**audit_env(audit_dir), **env}, cpus=topology.server_cpus)
    if topology.pinned:
        os.sched_setaffinity(0, topology.client)
    wrk_env = {"CRYPTD_CREDENTIALS": ""}
    server.start()
    try:
        wrk_env["CRYPTD_CREDENTIALS"] = str(server.credentials)
        run_wrk(
            "cryptd.lua",
            server.url,
            ["aes-encrypt"],
            connections=connections,
            duration=2,
            env=wrk_env,
        )
        syncers = sync_processes(server.pid)
        traced = ",".join(str(pid) for pid in [server.pid, *syncers])
        data = work / "perf.data"
        perf = subprocess.Popen(
            [*("perf", "record", "-q", "-o", str(data), "-p", traced), *TRACEPOINTS],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # perf attached
        sync_before = sum(tree_cpu_seconds(pid) for pid in syncers)
        found = run_wrk(
            "cryptd.lua",
            server.url,
            ["aes-encrypt"],
            connections=connections,
            duration=duration,
            env=wrk_env,
            server_pid=server.pid,
        )
        sync_cpu = sum(tree_cpu_seconds(pid) for pid in syncers) - sync_before
        perf.send_signal(signal.SIGINT)
        perf.wait(60)
    finally:
        server.stop()
    script = subprocess.run(
        ["perf", "script", "-i", str(data)], capture_output=True, text=True, check=True
    ).stdout
    sizes, syncs = group_sizes(script, median_record(audit_dir))
    return Groups(found.requests, found.seconds, found.server_cpu_s or 0.0, sync_cpu, syncs, sizes)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.audit_groups", description=__doc__)
    parser.add_argument("--connections", type=int, default=16, help="wrk connections")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds traced")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for the server (repeatable)"
    )
    parser.add_argument("--shared-cores", action="store_true", help="no pinning")
    parser.add_argument("--client-cpus", help="CPUs of wrk (default: the first half)")
    parser.add_argument("--server-cpus", help="CPUs of the server (default: the rest)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory(prefix="cryptd-audit-groups-") as scratch:
        found = measure(args, env, Path(scratch))
    print(f"{args.connections} connections: {found.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
