"""What the audit trail costs: AES-GCM encrypt throughput with the trail fail-closed against
the audit off, in one run. ``python -m loadtest.audit_cost``.

Two ``cryptd serve --dev`` servers (one worker each) on the server CPUs of the pinned topology
(loadtest/plan.py; wrk on the others): one with ``CRYPTD_AUDIT_LOG=off``, one with a chained
audit file, ``CRYPTD_AUDIT_FAIL_CLOSED=true`` (every answer waits for its record's group
``fdatasync``). wrk drives signed ``aes-encrypt`` requests at each in turn, alternating round by
round so drift on the machine hits both alike; the cost is ``1 - audited / off`` of the median
per-round ratio of requests per second per server core (goal: at most 10 %). The audit file
is put where ``--audit-dir`` says (default: a temporary directory; use the disk production
would). At the end the trail is proved with ``cryptd audit verify`` and its records counted
against the requests answered.

Where the cost comes from, in the same rounds: ``--memory-dir /dev/shm`` adds a server whose
trail is on a memory file system (every ``fdatasync`` returns at once: the trail's own work
without the disk's), and every round reports each server's CPU per request (its process tree,
the sync process included, from ``/proc``). The reference: ``--openbao`` adds OpenBao without
and with its file audit device (a request and a response entry per request, values HMAC'd,
never synced), so what an audit device costs OpenBao is measured in the same rounds.

The report (JSON) goes to ``loadtest/results/``; the summary is printed and, with
``--record``, written as ``docs/results/DATE-audit-cost.md``. Run it on a quiet machine: never
in CI. The alternation is loadtest/alternate.py's, shared with loadtest/seal_parity.py.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest import alternate
from loadtest.alternate import per_core
from loadtest.phase import describe, rsa_sign_us
from loadtest.plan import Topology, make_topology
from loadtest.sampling import prepare
from loadtest.scenarios import BY_NAME
from loadtest.targets import Cryptd, OpenBao

GOAL = 0.10  # the most the trail may cost of AES-GCM encrypt throughput per core


@dataclass
class Round:
    off_ops: float
    audited_ops: float
    baseline_ops: float | None = None  # with --baseline: the audited server of that tree
    memory_ops: float | None = None  # with --memory-dir: the trail on a memory file system
    cpu_us: dict[str, float] = field(default_factory=dict)  # server -> CPU us per request
    openbao_off_ops: float | None = None  # with --openbao: OpenBao without an audit device
    openbao_audited_ops: float | None = None  # ... and with its file audit device

    @property
    def ratio(self) -> float:
        return self.audited_ops / self.off_ops if self.off_ops else float("nan")

    @property
    def baseline_ratio(self) -> float:
        return _to_off(self.baseline_ops, self.off_ops)

    @property
    def memory_ratio(self) -> float:
        return _to_off(self.memory_ops, self.off_ops)

    @property
    def openbao_ratio(self) -> float:
        """OpenBao audited over OpenBao without an audit device."""
        return _to_off(self.openbao_audited_ops, self.openbao_off_ops or 0.0)


def _to_off(ops: float | None, off_ops: float) -> float:
    """A server's throughput over its audit-off counterpart's in the same round."""
    return ops / off_ops if ops is not None and off_ops else float("nan")


def _cost(ratios: Iterable[float]) -> float:
    """1 - the median per-round ratio: what the audit costs that server's throughput."""
    return 1 - statistics.median(ratios)


@dataclass
class Report:
    topology: str
    phase: str
    rounds: list[Round] = field(default_factory=list)
    audited_requests: int = 0
    records: int = 0
    verify_exit: int | None = None
    verify_output: str = ""
    baseline: str | None = None  # the other tree measured in the same run
    memory_dir: str | None = None  # where the memory-file-system server's trail went
    openbao: bool = False  # OpenBao without and with its audit device in the same rounds

    @property
    def baseline_cost(self) -> float | None:
        return None if self.baseline is None else _cost(r.baseline_ratio for r in self.rounds)

    @property
    def memory_cost(self) -> float | None:
        """The cost of the trail on a memory file system: its own work, no disk sync."""
        return None if self.memory_dir is None else _cost(r.memory_ratio for r in self.rounds)

    @property
    def openbao_cost(self) -> float | None:
        """What its file audit device costs OpenBao's throughput, from the same rounds."""
        return _cost(r.openbao_ratio for r in self.rounds) if self.openbao else None

    @property
    def cost(self) -> float:
        """1 - the median per-round throughput ratio (audited over off)."""
        return _cost(r.ratio for r in self.rounds)

    def summary(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "rounds"},
            "rounds": [{**asdict(r), "ratio": round(r.ratio, 4)} for r in self.rounds],
            "cost": round(self.cost, 4),
            "baseline_cost": None if self.baseline_cost is None else round(self.baseline_cost, 4),
            "memory_cost": None if self.memory_cost is None else round(self.memory_cost, 4),
            "openbao_cost": None if self.openbao_cost is None else round(self.openbao_cost, 4),
            "goal": GOAL,
            "met": self.cost <= GOAL and self.verify_exit == 0,
        }


def audit_env(directory: Path, group_delay_ms: float | None = None) -> dict[str, str]:
    env = {"CRYPTD_AUDIT_LOG": str(directory / "audit.log"), "CRYPTD_AUDIT_FAIL_CLOSED": "true"}
    if group_delay_ms is not None:
        env["CRYPTD_AUDIT_GROUP_DELAY_MS"] = f"{group_delay_ms:g}"
    return env


def audit_files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.iterdir() if p.name.startswith("audit.log"))


def count_records(files: Sequence[str], event: str = "encrypt") -> int:
    count = 0
    for name in files:
        for line in Path(name).read_bytes().splitlines():
            count += orjson.loads(line).get("event") == event
    return count


def verify_trail(server: Cryptd, files: Sequence[str]) -> subprocess.CompletedProcess[str]:
    dev = server.directory / "dev"
    command = [sys.executable, "-m", "service", "audit", "verify", *files]
    command += [
        "--keyring",
        str(dev / "keyring.json"),
        "--master-key-file",
        str(dev / "master.key"),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def measure(
    topology: Topology,
    rounds: int,
    duration: float,
    connections: int,
    audit_dir: Path,
    work: Path,
    group_delay_ms: float | None = None,
    baseline: Path | None = None,
    memory_dir: Path | None = None,
    openbao: bool = False,
) -> Report:
    report = Report(topology.summary(), describe(rsa_sign_us()), openbao=openbao)
    cpus = topology.server_cpus
    off = Cryptd(work / "off", env={"CRYPTD_AUDIT_LOG": "off"}, cpus=cpus, name="audit-off")
    audited = Cryptd(
        work / "audited", env=audit_env(audit_dir, group_delay_ms), cpus=cpus, name="audited"
    )
    servers: tuple[Cryptd, ...] = (off, audited)
    if baseline is not None:  # the same audited server, run from another checkout's code
        report.baseline = str(baseline)
        base_dir = audit_dir.parent / f"{audit_dir.name}-baseline"
        base_dir.mkdir()
        env = {**audit_env(base_dir, group_delay_ms), "PYTHONPATH": str(baseline.resolve())}
        servers += (Cryptd(work / "baseline", env=env, cpus=cpus, name="baseline"),)
    if memory_dir is not None:  # the same audited server, its trail where no sync waits
        report.memory_dir = str(memory_dir)
        env = audit_env(memory_dir, group_delay_ms)
        servers += (Cryptd(work / "memory", env=env, cpus=cpus, name="memory"),)
    baos: tuple[OpenBao, ...] = ()
    if openbao:
        baos = (
            OpenBao(work / "openbao-off", cpus, name="openbao-off"),
            OpenBao(work / "openbao-audited", cpus, audit=True, name="openbao-audited"),
        )
    every: tuple[Cryptd | OpenBao, ...] = (*servers, *baos)
    try:
        for server in every:
            server.start()
        bodies = prepare(baos, [BY_NAME["aes-encrypt"]], work / "bodies").files
        found = alternate.rounds(
            every,
            topology,
            rounds,
            duration=duration,
            connections=connections,
            bodies={name: path for (name, _), path in bodies.items()},
        )
        for figures in found:
            cores = topology.server_cores
            report.audited_requests += figures["audited"].requests
            ops = {name: per_core(m, cores) for name, m in figures.items()}
            report.rounds.append(
                Round(
                    ops["audit-off"],
                    ops["audited"],
                    ops.get("baseline"),
                    ops.get("memory"),
                    {
                        name: round(m.server_cpu_s / m.requests * 1e6, 1)
                        for name, m in figures.items()
                        if m.server_cpu_s is not None and m.requests
                    },
                    ops.get("openbao-off"),
                    ops.get("openbao-audited"),
                )
            )
    finally:
        for server in every:
            server.stop()
    files = audit_files(audit_dir)
    report.records = count_records(files)
    checked = verify_trail(audited, files)
    report.verify_exit = checked.returncode
    report.verify_output = (checked.stdout + checked.stderr).strip()[-2000:]
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.audit_cost", description=__doc__)
    parser.add_argument("--rounds", type=int, default=6, help="alternations (default 6)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections")
    parser.add_argument(
        "--audit-dir", type=Path, help="where the audit files go (a new directory in it per run)"
    )
    parser.add_argument(
        "--group-delay-ms",
        type=float,
        help="the audited server's CRYPTD_AUDIT_GROUP_DELAY_MS (default: the service's)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of other code (a source tree): its audited server is measured in the"
        " same rounds, for an A/B of two versions of the trail on one machine state",
    )
    parser.add_argument(
        "--memory-dir",
        type=Path,
        help="also measure an audited server whose trail goes under this directory of a memory"
        " file system (e.g. /dev/shm), in the same rounds: the trail's cost without the disk",
    )
    parser.add_argument(
        "--openbao",
        action="store_true",
        help="also measure OpenBao without and with its file audit device in the same rounds:"
        " what an audit device costs the reference",
    )
    parser.add_argument("--shared-cores", action="store_true", help="no pinning")
    parser.add_argument("--client-cpus", help="CPUs of wrk (default: the first half)")
    parser.add_argument("--server-cpus", help="CPUs of the servers (default: the rest)")
    parser.add_argument("--out", type=Path, help="the JSON report (default: loadtest/results/)")
    parser.add_argument(
        "--record", action="store_true", help="also write docs/results/DATE-audit-cost.md"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.connections < 1:
        parser.error("--rounds, --duration and --connections must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    topology = make_topology(args)
    with tempfile.TemporaryDirectory(prefix="cryptd-audit-cost-") as scratch:
        work = Path(scratch)
        if args.audit_dir:  # a directory of this run's own: the trail verified is this run's
            args.audit_dir.mkdir(parents=True, exist_ok=True)
            audit_dir = Path(tempfile.mkdtemp(prefix="audit-cost-", dir=args.audit_dir))
        else:
            audit_dir = work / "audit"
            audit_dir.mkdir()
        memory_dir = None
        if args.memory_dir:
            args.memory_dir.mkdir(parents=True, exist_ok=True)
            memory_dir = Path(tempfile.mkdtemp(prefix="audit-cost-", dir=args.memory_dir))
        report = measure(
            topology,
            args.rounds,
            args.duration,
            args.connections,
            audit_dir,
            work,
            args.group_delay_ms,
            args.baseline,
            memory_dir,
            args.openbao,
        )
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)  # memory, not disk: give it back
    summary = report.summary()
    stamp = alternate.stamp()
    text = markdown(report, args, stamp)
    alternate.publish("audit-cost", summary, text, stamp, args.out, args.record)
    return 0 if summary["met"] else 1


def _beside(title: str, cost: float | None, rounds: list[tuple[float | None, float]]) -> str:
    """The paragraph of a server measured beside the two (none when it was not)."""
    if cost is None:
        return ""
    figures = ", ".join(f"{ops or 0:,.0f} ({ratio:.3f})" for ops, ratio in rounds)
    return f"\n\n{title}: **cost {cost:.1%}**; per round req/s per core: {figures}."


def markdown(report: Report, args: argparse.Namespace, stamp: str) -> str:
    rows = "\n".join(
        f"| {n} | {r.off_ops:,.0f} | {r.audited_ops:,.0f} | {r.ratio:.3f} |"
        for n, r in enumerate(report.rounds, 1)
    )
    baseline = _beside(
        f"Baseline (`--baseline {report.baseline}`, the same audited server from that tree, in"
        " the same rounds)",
        report.baseline_cost,
        [(r.baseline_ops, r.baseline_ratio) for r in report.rounds],
    )
    memory = _beside(
        "The trail on a memory file system (`--memory-dir`, every sync at once, in the same"
        " rounds)",
        report.memory_cost,
        [(r.memory_ops, r.memory_ratio) for r in report.rounds],
    )
    openbao = _beside(
        "OpenBao with its file audit device against OpenBao without (`--openbao`, AES-GCM"
        " encrypt through Transit, in the same rounds; OpenBao writes a request and a response"
        " entry and never syncs them)",
        report.openbao_cost,
        [(r.openbao_audited_ops, r.openbao_ratio) for r in report.rounds],
    )
    cpu = ""
    if any(r.cpu_us for r in report.rounds):
        cpu = (
            "\n\nServer CPU per request (process tree, µs), per round: "
            + "; ".join(
                ", ".join(f"{name} {us:g}" for name, us in r.cpu_us.items()) for r in report.rounds
            )
            + "."
        )
    return (
        f"# Audit trail cost ({stamp})\n\n"
        f"- {report.topology}; {report.phase}\n"
        f"- `python -m loadtest.audit_cost --rounds {args.rounds} --duration {args.duration:g}"
        f" --connections {args.connections}"
        + (f" --group-delay-ms {args.group_delay_ms:g}" if args.group_delay_ms is not None else "")
        + (f" --memory-dir {args.memory_dir}" if args.memory_dir is not None else "")
        + (" --openbao" if args.openbao else "")
        + "`\n"
        f"- AES-GCM encrypt, one worker; audited: `CRYPTD_AUDIT_LOG` file, fail-closed, group"
        f" `fdatasync`\n\n"
        f"| round | audit off req/s per core | audited | ratio |\n|---|---|---|---|\n{rows}\n\n"
        f"**Cost: {report.cost:.1%}** of throughput per core (goal <= {GOAL:.0%}); "
        f"{report.records} encrypt records for {report.audited_requests} requests answered; "
        f"`cryptd audit verify` exit {report.verify_exit}." + baseline + memory + openbao + cpu
    )


if __name__ == "__main__":
    sys.exit(main())
