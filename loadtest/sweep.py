"""Several cryptd configurations against each other in one run, alternating, on the runner's
pinned topology: the way to choose a setting when the host's speed drifts from minute to
minute.

    python -m loadtest.sweep --config share35=CRYPTD_SLICE_SHARE=0.35 \\
        --config share60=CRYPTD_SLICE_SHARE=0.6 --openbao --scenarios mix,rsa-sign

Every configuration is a ``cryptd serve --dev`` of its own (``NAME=VAR=VALUE,VAR=VALUE``: extra
environment; ``PYTHONPATH=DIR`` runs another checkout's ``service``; ``--python NAME=PATH`` runs
it on another interpreter, a venv's python where cryptd is installed), all started at once on
the server CPUs and measured one after the other, in an order reversed every round, so that a
slow minute falls on all of them alike. A mix is measured as the runner measures it (its
streams at once, then its ``alone`` stream by itself). With ``--openbao``, OpenBao is one more
target, and the goals are computed round by round, each configuration against the OpenBao
measured beside it (the mix's: each stream at least 1.5x OpenBao's, the cheap stream's P99 at
most twice its P99 alone), then the median over the rounds: a ratio of neighbours is steadier
than a ratio of medians taken minutes apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.measure import Measurement
from loadtest.options import env_pair
from loadtest.plan import Plan, make_plan, make_topology
from loadtest.progress import describe, log
from loadtest.report import MIX_GOAL, MIX_P99_GOAL
from loadtest.run import parse_args as run_parse_args
from loadtest.sampling import Prepared, measure, measure_mix, prepare
from loadtest.scenarios import BY_NAME, MIX_BY_NAME, Scenario
from loadtest.targets import Cryptd, OpenBao

OPENBAO = "openbao"


@dataclass
class Target:
    name: str
    server: Cryptd | OpenBao
    prepared: Prepared | None = None
    runs: dict[str, list[Measurement]] = field(default_factory=dict)

    def add(self, what: str, measurement: Measurement) -> None:
        self.runs.setdefault(what, []).append(measurement)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=VAR=VALUE,VAR=VALUE`` (or ``NAME=`` for the defaults) -> (NAME, environment)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or name == OPENBAO:
        raise argparse.ArgumentTypeError(f"expected NAME=VAR=VALUE,...: {text!r}")
    return name, dict(env_pair(pair) for pair in rest.split(",") if pair)


def parse_python(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH): the interpreter configuration NAME runs on."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH: {text!r}")
    return name, path


def _scenarios_of(names: Sequence[str]) -> list[Scenario]:
    found: list[Scenario] = []
    for name in names:
        if name in MIX_BY_NAME:
            found += [BY_NAME[stream] for stream, _ in MIX_BY_NAME[name].streams]
        else:
            found.append(BY_NAME[name])
    return list(dict.fromkeys(found))


def measure_round(target: Target, plan: Plan, names: Sequence[str], round_no: int) -> None:
    assert target.prepared is not None
    for name in names:
        if name not in MIX_BY_NAME:
            m = measure(target.server, BY_NAME[name], target.prepared, plan, plan.duration)
            target.add(name, m)
            log(f"round {round_no} {target.name} {name}: {describe(m)}")
            continue
        mix = MIX_BY_NAME[name]
        streams = measure_mix(target.server, mix, target.prepared, plan, plan.duration)
        for stream, m in streams.items():
            target.add(f"{name}:{stream}", m)
        connections = dict(mix.streams)[mix.alone]
        alone = measure(
            target.server, BY_NAME[mix.alone], target.prepared, plan, plan.duration, connections
        )
        target.add(f"{name}:alone", alone)
        parts = [f"{stream} {describe(m)}" for stream, m in streams.items()]
        log(f"round {round_no} {target.name} {name}: " + "; ".join(parts))
        log(f"round {round_no} {target.name} {name}: {mix.alone} alone {describe(alone)}")


def report(targets: Sequence[Target], names: Sequence[str]) -> str:
    """Medians per target, and the goals against OpenBao round by round where it ran."""
    lines = [
        "| target | measured | ops/s | server CPU us/request | P50 ms | P99 ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for target in targets:
        for what, runs in target.runs.items():
            ops = statistics.median(m.ops for m in runs)
            # A mix's streams share the server's CPU: per request only for one scenario alone.
            cpu = [
                m.server_cpu_s / m.requests * 1e6
                for m in runs
                if m.server_cpu_s and m.requests and ":" not in what
            ]
            per_request = f"{statistics.median(cpu):,.0f}" if cpu else "-"
            p50 = statistics.median(m.p50_ms for m in runs)
            p99 = statistics.median(m.p99_ms for m in runs)
            lines.append(
                f"| {target.name} | {what} | {ops:,.0f} | {per_request} | {p50:.2f} | {p99:.2f} |"
            )
    bao = next((t for t in targets if t.name == OPENBAO), None)
    if bao is None:
        return "\n".join(lines)
    lines += ["", "Against the OpenBao of the same round, median of the rounds:", ""]
    lines += ["| target | measured | x OpenBao | goal |", "|---|---|---:|---|"]
    for target in targets:
        if target is bao:
            continue
        for name in names:
            if name in MIX_BY_NAME:
                mix = MIX_BY_NAME[name]
                for stream, _ in mix.streams:
                    key = f"{name}:{stream}"
                    ratio = _median_ratio(target.runs[key], bao.runs[key], "ops")
                    ok = "PASS" if ratio >= MIX_GOAL else "FAIL"
                    lines.append(f"| {target.name} | {key} ops/s | {ratio:.2f}x | {ok} |")
                cheap = target.runs[f"{name}:{mix.alone}"]
                ratio = _median_ratio(cheap, target.runs[f"{name}:alone"], "p99_ms")
                ok = "PASS" if ratio <= MIX_P99_GOAL else "FAIL"
                lines.append(
                    f"| {target.name} | {name}:{mix.alone} P99 / alone | {ratio:.2f} | {ok} |"
                )
            elif name in bao.runs:
                ratio = _median_ratio(target.runs[name], bao.runs[name], "ops")
                lines.append(f"| {target.name} | {name} ops/s | {ratio:.2f}x | |")
    return "\n".join(lines)


def _median_ratio(ours: Sequence[Measurement], theirs: Sequence[Measurement], what: str) -> float:
    pairs = [
        getattr(a, what) / getattr(b, what)
        for a, b in zip(ours, theirs, strict=False)
        if getattr(b, what)
    ]
    return statistics.median(pairs) if pairs else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sweep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--config",
        type=parse_config,
        action="append",
        required=True,
        metavar="NAME=ENV",
        help="a cryptd configuration: NAME=VAR=VALUE,VAR=VALUE (NAME= for the defaults)",
    )
    parser.add_argument(
        "--python",
        type=parse_python,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="the interpreter configuration NAME runs on (default: this one)",
    )
    parser.add_argument("--openbao", action="store_true", help="OpenBao as one more target")
    parser.add_argument("--scenarios", default="mix", help="scenarios and mixes (mix)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    args, rest = parser.parse_known_args(argv)
    names = args.scenarios.split(",")
    pythons = dict(args.python)
    strays = set(pythons) - {name for name, _ in args.config}
    if strays:
        parser.error(f"--python for no configuration: {', '.join(sorted(strays))}")
    unknown = [n for n in names if n not in BY_NAME and n not in MIX_BY_NAME]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    # The runner's own options for the rest (topology, connections, quiet machine).
    runner_args = run_parse_args(
        [
            *rest,
            "--duration",
            str(args.duration),
            "--rounds",
            str(args.rounds),
            "--scenarios",
            args.scenarios,
            "--no-ceiling",
            "--no-case-study",
        ]
    )
    plan = make_plan(runner_args)
    topology = make_topology(runner_args)
    log(f"{topology.summary()}; {len(args.config)} configuration(s)")
    work = Path(tempfile.mkdtemp(prefix="cryptd-sweep-"))
    targets = [
        Target(
            name,
            Cryptd(work / name, 1, env, topology.server_cpus, python=pythons.get(name, "")),
        )
        for name, env in args.config
    ]
    if args.openbao:
        targets.append(Target(OPENBAO, OpenBao(work / OPENBAO, topology.server_cpus)))
    try:
        for target in targets:
            target.server.start()
            target.prepared = prepare([target.server], _scenarios_of(names), work / target.name)
        for round_no in range(1, args.rounds + 1):
            for target in targets if round_no % 2 else targets[::-1]:
                measure_round(target, plan, names, round_no)
    finally:
        for target in targets:
            target.server.stop()
    print(report(targets, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
