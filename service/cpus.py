"""How many CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota.

``os.cpu_count()`` is the machine's count. A container limited to two CPUs on a 64-core node
(Kubernetes ``limits.cpu: 2``) sees 64 there, and 64 busy workers in a 2-CPU quota would spend
most of each scheduling period throttled. The quota is ``cpu.max`` in cgroup v2 (``"200000
100000"``: 2 CPUs; ``"max 100000"``: none) or ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in
cgroup v1, set on the process's own cgroup or on an ancestor (the smallest applies). A
fractional quota rounds down (1.5 CPUs: 1), never below one: a worker beyond the quota would
only be throttled.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path

QuotaReader = Callable[[Path], float | None]


def available_cpus(root: Path = Path("/")) -> int:
    """CPUs this process may run on at once, at least 1 (``root``: for tests)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)


def cgroup_cpu_limit(root: Path = Path("/")) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs (2.0, 0.5, ...); None without one."""
    try:
        memberships = (root / "proc/self/cgroup").read_text()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in memberships.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # the cgroup v2 hierarchy
            mount = _mount(mounts, lambda fstype, options: fstype == "cgroup2")
            reader: QuotaReader = _read_v2
        elif "cpu" in controllers.split(","):  # a cgroup v1 hierarchy with the cpu controller
            mount = _mount(mounts, lambda fstype, opts: fstype == "cgroup" and "cpu" in opts)
            reader = _read_v1
        else:
            continue
        if mount is not None:
            limits.extend(_quotas(root, *mount, path, reader))
    return min(limits) if limits else None


def _mount(mounts: list[str], wanted: Callable[[str, list[str]], bool]) -> tuple[str, str] | None:
    """(path of the mount's root inside the hierarchy, mount point) of the first match."""
    for line in mounts:
        # id parent major:minor root mount-point options [optional...] - fstype source super
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) > dash + 3 and wanted(fields[dash + 1], fields[dash + 3].split(",")):
            return _unescape(fields[3]), _unescape(fields[4])
    return None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040 ...).
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _quotas(
    root: Path, mount_root: str, mount_point: str, path: str, reader: QuotaReader
) -> list[float]:
    """The quotas on the process's cgroup and on each ancestor up to the mount point."""
    top = root / mount_point.lstrip("/")
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :]
    directory = top / path.lstrip("/")
    if not directory.is_dir():
        # Without a cgroup namespace a container sees its host-side path, while its own cgroup
        # is what is mounted: the mount point is the cgroup then.
        directory = top
    found = []
    while True:
        limit = reader(directory)
        if limit is not None:
            found.append(limit)
        if directory == top or top not in directory.parents:
            return found
        directory = directory.parent


def _read_v2(directory: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        if quota != "max":
            return int(quota) / int(period or "100000")
    return None


def _read_v1(directory: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:  # -1: no quota
            return quota / period
    return None
