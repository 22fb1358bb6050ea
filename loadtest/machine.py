"""What a result records about the machine: CPU, kernel, the interpreter that served, tool
versions, git head and load average."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtest.measure import find_wrk
from loadtest.targets import (
    find_bao,
)


def _cores() -> int:
    return os.cpu_count() or 1


def _version(command: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
        text = (done.stdout or done.stderr).strip().splitlines()
        return text[0] if text else ""
    return ""


def interpreter() -> str:
    """The CPython that runs cryptd and the bare app (the targets start ``sys.executable``): its
    version and base executable, outside any venv. How it was built moves every figure: the
    image's CPython is built with PGO and LTO; on a pyenv build with neither cryptd spends 11-20 %
    more CPU a request (docs/PERFORMANCE.md, "The interpreter")."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    return f"{platform.python_implementation()} {platform.python_version()} ({base})"


def interpreter_of(machine: dict[str, Any]) -> str:
    """The interpreter a result records; a run from before it was recorded gives its version."""
    found: str | None = machine.get("interpreter")
    return found or f"Python {machine['python']}"


def served_by(machine: dict[str, Any]) -> str:
    """The README line's "cryptd and the bare app on ...; ", empty for a run without it."""
    found = machine.get("interpreter")
    return f"cryptd and the bare app on {found}; " if found else ""


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from service import __version__

    return {
        "cpu": model,
        "cores": _cores(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "interpreter": interpreter(),
        "wrk": _version([find_wrk() or "wrk", "-v"]),
        "openbao": _version([find_bao(), "version"]),
        "cryptd": __version__,
        "git_head": _version(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]
        ),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
