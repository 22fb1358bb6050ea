"""CPUs available to the process: the affinity mask and the cgroup CPU quota (v2 and v1, on
the process's cgroup or an ancestor, with or without a cgroup namespace). The quota files are
laid out as the kernel shows them, under a temporary root; the affinity is the real one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cpus import available_cpus, cgroup_cpu_limit

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "33 31 0:30 / /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpuset\n"
)


def _layout(root: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for path, content in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    return root


def test_v2_quota_of_the_own_cgroup(tmp_path: Path) -> None:
    root = _layout(
        tmp_path,
        "0::/kubepods/pod1/c1\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "200000 100000\n",
        },
    )
    assert cgroup_cpu_limit(root) == 2.0


def test_v2_the_smallest_ancestor_quota_applies(tmp_path: Path) -> None:
    root = _layout(
        tmp_path,
        "0::/a/b\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/a/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/a/b/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpu_limit(root) == 1.5


def test_v2_no_quota(tmp_path: Path) -> None:
    root = _layout(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root) is None


def test_v2_container_without_cgroup_namespace(tmp_path: Path) -> None:
    # The host-side path is not below the mount: the mount point is the container's cgroup.
    root = _layout(
        tmp_path,
        "0::/system.slice/docker-abc.scope\n",
        V2_MOUNT,
        {"sys/fs/cgroup/cpu.max": "50000 100000\n"},
    )
    assert cgroup_cpu_limit(root) == 0.5


def test_v1_cfs_quota(tmp_path: Path) -> None:
    root = _layout(
        tmp_path,
        "4:cpuset:/\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        V1_MOUNTS,
        {
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_limit(root) == 3.0


def test_v1_without_quota_and_unreadable_files(tmp_path: Path) -> None:
    root = _layout(
        tmp_path,
        "3:cpu,cpuacct:/\n",
        V1_MOUNTS,
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_limit(root) is None
    assert cgroup_cpu_limit(tmp_path / "nowhere") is None


def test_the_quota_caps_the_affinity_and_rounds_down(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    half = _layout(tmp_path / "a", "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "50000 100000"})
    assert available_cpus(half) == 1  # never below one
    big = _layout(tmp_path / "b", "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "6400000 100000"})
    assert available_cpus(big) == affinity  # a quota above the CPUs we may use changes nothing
    if affinity >= 2:
        one_and_half = _layout(
            tmp_path / "c", "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "150000 100000"}
        )
        assert available_cpus(one_and_half) == 1


def test_the_affinity_mask_is_honoured() -> None:
    """A process pinned to one CPU (taskset, a CPU manager) counts one, whatever the machine."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU only: nothing to restrict")
    cpu = min(os.sched_getaffinity(0))
    code = "from service.cpus import available_cpus; print(available_cpus())"
    result = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "1"


def test_this_machine() -> None:
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)
