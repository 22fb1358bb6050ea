"""One measurement: wrk (closed loop) against one target, with the CPU the server and the
client spent, as a :class:`Measurement`."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from loadtest.procstat import CpuWindow

WRK_DIR: Final = Path(__file__).resolve().parent / "wrk"
MARKER: Final = "WRK_JSON "


@dataclass(frozen=True)
class Measurement:
    """Figures of one run. Latencies in milliseconds; ``items`` operations per request."""

    requests: int
    seconds: float
    errors: int  # non-2xx answers, socket errors and timeouts
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    items: int = 1
    server_cpu_s: float | None = None
    client_cpu_s: float | None = None
    others_cpu_s: float | None = None  # CPU other processes took from the shared cores
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def ops(self) -> float:
        """Operations per second (items/s for a batch)."""
        return self.rps * self.items

    @property
    def ops_per_cpu_second(self) -> float | None:
        """Operations per server CPU second: the capacity of one fully used core."""
        if not self.server_cpu_s:
            return None
        return self.requests * self.items / self.server_cpu_s

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(rps=self.rps, ops=self.ops, ops_per_cpu_second=self.ops_per_cpu_second)
        return data


def find_wrk() -> str | None:
    return shutil.which("wrk")


def parse_wrk_output(stdout: str) -> dict[str, Any]:
    """The ``WRK_JSON`` line the scripts' ``done()`` prints."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            parsed: dict[str, Any] = orjson.loads(line[len(MARKER) :])
            return parsed
    raise RuntimeError(f"wrk printed no {MARKER.strip()} line:\n{stdout[-2000:]}")


@dataclass(frozen=True)
class WrkStream:
    """One wrk process of a measurement: ``script`` with its arguments against ``url``."""

    script: str
    url: str
    args: list[str]
    connections: int
    threads: int = 1
    env: Mapping[str, str] | None = None
    items: int = 1


def run_wrk(
    script: str,
    url: str,
    args: list[str],
    *,
    connections: int,
    duration: float,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    server_pid: int | Sequence[int] | None = None,
    items: int = 1,
    timeout_s: float = 10.0,
) -> Measurement:
    """Run ``wrk -s loadtest/wrk/<script>`` for ``duration`` seconds and return its figures.

    Server CPU is read from /proc around the run, client CPU is wrk's own rusage, and the
    CPU everything else on the machine took in the meantime is reported too.
    """
    stream = WrkStream(script, url, args, connections, threads, env, items)
    return run_wrk_streams([stream], duration=duration, server_pid=server_pid, timeout_s=timeout_s)[
        0
    ]


def run_wrk_streams(
    streams: Sequence[WrkStream],
    *,
    duration: float,
    server_pid: int | Sequence[int] | None = None,
    timeout_s: float = 10.0,
) -> list[Measurement]:
    """Run several wrk processes at once (mixed traffic) and return each one's figures. The
    CPU figures (server, client, others) are those of the whole window, the same in each."""
    wrk = find_wrk()
    if wrk is None:
        raise RuntimeError("wrk is not installed (apt-get install -y wrk)")
    commands = [
        [
            wrk,
            f"-t{stream.threads}",
            f"-c{stream.connections}",
            f"-d{max(1, round(duration))}s",
            f"--timeout={max(1, round(timeout_s))}s",
            "-s",
            str(WRK_DIR / stream.script),
            stream.url,
            "--",
            *stream.args,
        ]
        for stream in streams
    ]
    with CpuWindow(server_pid, "children") as window:
        processes = [
            subprocess.Popen(
                command,
                env={**os.environ, **(stream.env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for command, stream in zip(commands, streams, strict=True)
        ]
        outputs = [process.communicate(timeout=duration + 60) for process in processes]
    cpu = window.usage
    assert cpu is not None
    results = []
    for process, (stdout, stderr), stream in zip(processes, outputs, streams, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"wrk failed ({process.returncode}): {stderr[-2000:]}")
        results.append(_measurement(parse_wrk_output(stdout), stream.items, cpu))
    return results


def _measurement(data: dict[str, Any], items: int, cpu: Any) -> Measurement:
    errors: dict[str, int] = data["errors"]
    latency = data["latency_us"]
    seconds = data["duration_us"] / 1e6
    return Measurement(
        requests=int(data["requests"]),
        seconds=seconds,
        errors=sum(int(v) for v in errors.values()),
        p50_ms=latency["p50"] / 1000,
        p99_ms=latency["p99"] / 1000,
        mean_ms=latency["mean"] / 1000,
        max_ms=latency["max"] / 1000,
        items=items,
        server_cpu_s=cpu.server,
        client_cpu_s=cpu.client,
        others_cpu_s=cpu.others,
        detail={
            "errors": errors,
            "p90_ms": latency["p90"] / 1000,
            "p999_ms": latency["p999"] / 1000,
        },
    )
