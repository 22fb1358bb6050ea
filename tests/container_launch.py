"""Start one process of a container the way a container runtime does, from the mount namespace
the caller prepared: change root into the image's filesystem, take the image's user with no
capabilities and no way to gain privileges (Kubernetes' `capabilities: drop: [ALL]` and
`allowPrivilegeEscalation: false`), then exec the command with the image's environment.

    python container_launch.py '{"root": ..., "uid": ..., "gid": ..., "cwd": ..., "env": {...},
                                 "argv": [...], "keep_privileges": false}'

Standard library only: it runs with this checkout's interpreter, outside the image, up to the
exec. Used by tests/test_container_image.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import NoReturn

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}, {arg}): {os.strerror(error)}")


def main() -> NoReturn:
    spec = json.loads(sys.argv[1])
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last_cap = int(fh.read())
    os.chroot(spec["root"])
    os.chdir(spec.get("cwd") or "/")
    if not spec.get("keep_privileges", False):
        for cap in range(last_cap + 1):
            _prctl(PR_CAPBSET_DROP, cap)
        os.setgroups([])
        os.setgid(spec["gid"])
        # Leaving uid 0 for another clears the permitted, effective and ambient sets.
        os.setuid(spec["uid"])
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    argv = spec["argv"]
    # PATH from the image's environment, searched inside the new root.
    os.execvpe(argv[0], argv, spec["env"])  # noqa: S606


if __name__ == "__main__":
    main()
