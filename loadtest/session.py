"""The frame of one load-test run, the same for every campaign command: the load generator
pinned to its CPUs, a private working directory, the result's machine and configuration, and
at the end the outputs (the printed report, the JSON under loadtest/results/, and with
``--record`` the summary under docs/results/)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from loadtest import records
from loadtest.machine import machine
from loadtest.measure import find_wrk
from loadtest.options import reproduce_command
from loadtest.plan import Plan
from loadtest.progress import log

RESULTS_DIR: Final = Path(__file__).resolve().parent / "results"  # every run, raw (not tracked)


@dataclass
class Session:
    plan: Plan
    workdir: Path
    started: str = field(default_factory=lambda: f"{dt.datetime.now(dt.UTC):%Y-%m-%dT%H:%M:%SZ}")
    result: dict[str, Any] = field(default_factory=dict)

    def config(self, module: str, argv: Sequence[str] | None) -> dict[str, Any]:
        """The plan, the topology and the command that measures the same again."""
        topology = self.plan.topology
        return {
            **asdict(self.plan),
            "topology": topology.summary(),
            "server_cores": topology.server_cores,
            "command": reproduce_command(module, sys.argv[1:] if argv is None else argv),
        }


def wrk_missing() -> bool:
    if find_wrk() is not None:
        return False
    print("wrk is not installed: apt-get install -y wrk", file=sys.stderr)
    return True


@contextlib.contextmanager
def session(plan: Plan, prefix: str, keep: bool) -> Iterator[Session]:
    """Pin this process (and so wrk and the open-loop generator, its children) to the load
    generators' CPUs; every server is started on the others."""
    topology = plan.topology
    if topology.pinned:
        os.sched_setaffinity(0, topology.client)
    current = Session(plan, Path(tempfile.mkdtemp(prefix=prefix)))
    current.result.update(started=current.started, machine=machine())
    log(f"working directory {current.workdir}; {topology.summary()}")
    try:
        yield current
    finally:
        if keep:
            log(f"kept {current.workdir}")
        else:
            shutil.rmtree(current.workdir, ignore_errors=True)


def write_outputs(
    current: Session, args: argparse.Namespace, kind: str, report: str, summary: str
) -> Path:
    """Print ``report``; write the JSON, the Markdown copy and, with ``--record``, ``summary``
    as docs/results/DATE-KIND.md. Returns the JSON's path."""
    result = current.result
    result["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print(report)
    stamp = current.started.replace(":", "")
    default = RESULTS_DIR / (f"{stamp}.json" if kind == "http" else f"{kind}-{stamp}.json")
    out: Path = args.json or default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if args.markdown:
        args.markdown.write_text(report + "\n")
    if args.record:
        started = dt.datetime.strptime(current.started, "%Y-%m-%dT%H:%M:%SZ")
        log(f"recorded {records.keep(kind, summary, started)}")
    log(f"results: {out}")
    return out
