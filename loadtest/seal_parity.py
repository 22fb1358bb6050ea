"""Seal parity: once unsealed, crypto runs at the same speed whatever keeps the master key.
``python -m loadtest.seal_parity``.

Three servers (one worker each, loadtest/seals.py) on the server CPUs of the pinned topology,
the same development state and settings but the seal: ``static`` (the reference), ``pkcs11``
(SoftHSM2) and ``shamir`` (started sealed, unsealed through its API). wrk drives signed
requests of each scenario (default AES-GCM encrypt and Ed25519 sign) at each in turn,
alternating round by round (loadtest/alternate.py); a seal's figure is the median per-round
ratio of its requests per second per server core to static's. Goal: every ratio within
``--tolerance`` (default 5 %) of 1.

The report (JSON) goes to ``loadtest/results/``; with ``--record`` the summary is written as
``docs/results/DATE-seal-parity.md``. Run it on a quiet machine: never in CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import alternate
from loadtest.alternate import per_core
from loadtest.phase import describe, rsa_sign_us
from loadtest.plan import make_topology
from loadtest.seals import SEALS, sealed_server

REFERENCE = "static"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.seal_parity", description=__doc__)
    parser.add_argument("--seals", default="pkcs11,shamir", help="compared with static")
    parser.add_argument(
        "--scenarios", default="aes-encrypt,ed25519-sign", help="wrk scenarios (cryptd.lua)"
    )
    parser.add_argument("--rounds", type=int, default=6, help="alternations (default 6)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections")
    parser.add_argument("--tolerance", type=float, default=0.05, help="|ratio - 1| allowed")
    parser.add_argument("--shared-cores", action="store_true", help="no pinning")
    parser.add_argument("--client-cpus", help="CPUs of wrk (default: the first half)")
    parser.add_argument("--server-cpus", help="CPUs of the servers (default: the rest)")
    parser.add_argument("--out", type=Path, help="the JSON report (default: loadtest/results/)")
    parser.add_argument(
        "--record", action="store_true", help="also write docs/results/DATE-seal-parity.md"
    )
    args = parser.parse_args(argv)
    args.seals = [s for s in args.seals.split(",") if s]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if not set(args.seals) <= set(SEALS) - {REFERENCE} or not args.seals:
        parser.error(f"--seals: some of {', '.join(s for s in SEALS if s != REFERENCE)}")
    if args.rounds < 1 or args.duration <= 0 or args.connections < 1 or not args.scenarios:
        parser.error("--rounds, --duration, --connections and --scenarios must be positive")
    return args


def judge(
    per_round: dict[str, dict[str, list[float]]], seals: Sequence[str], tolerance: float
) -> dict[str, Any]:
    """Per scenario and seal, the median ratio to static; met when each is within
    ``tolerance`` of 1."""
    ratios = {
        scenario: {
            seal: round(alternate.median_ratio(figures[seal], figures[REFERENCE]), 4)
            for seal in seals
        }
        for scenario, figures in per_round.items()
    }
    met = all(abs(r - 1) <= tolerance for by_seal in ratios.values() for r in by_seal.values())
    return {"ratios": ratios, "tolerance": tolerance, "met": met}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    topology = make_topology(args)
    names = [REFERENCE, *args.seals]
    per_round: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="cryptd-seal-parity-") as scratch:
        servers = [
            sealed_server(seal, Path(scratch) / seal, cpus=topology.server_cpus) for seal in names
        ]
        try:
            for server in servers:
                server.start()
            for scenario in args.scenarios:
                print(f"scenario {scenario}", file=sys.stderr)
                found = alternate.rounds(
                    servers,
                    topology,
                    args.rounds,
                    duration=args.duration,
                    connections=args.connections,
                    scenario=scenario,
                )
                per_round[scenario] = {
                    name: [per_core(r[name], topology.server_cores) for r in found]
                    for name in names
                }
        finally:
            for server in servers:
                server.stop()
    verdict = judge(per_round, args.seals, args.tolerance)
    stamp = alternate.stamp()
    summary = {
        "topology": topology.summary(),
        "phase": describe(rsa_sign_us()),
        "rounds": per_round,
        **verdict,
    }
    alternate.publish(
        "seal-parity", summary, markdown(summary, args, stamp), stamp, args.out, args.record
    )
    return 0 if verdict["met"] else 1


def markdown(summary: dict[str, Any], args: argparse.Namespace, stamp: str) -> str:
    header = " | ".join(f"{s} / static" for s in args.seals)
    rows = "\n".join(
        f"| {scenario} | {sum(summary['rounds'][scenario][REFERENCE]) / args.rounds:,.0f} | "
        + " | ".join(f"{by_seal[s]:.3f}" for s in args.seals)
        + " |"
        for scenario, by_seal in summary["ratios"].items()
    )
    return (
        f"# Seal parity ({stamp})\n\n"
        f"- {summary['topology']}; {summary['phase']}\n"
        f"- `python -m loadtest.seal_parity --seals {','.join(args.seals)} --scenarios"
        f" {','.join(args.scenarios)} --rounds {args.rounds} --duration {args.duration:g}"
        f" --connections {args.connections}`\n\n"
        f"| scenario | static req/s per core (mean) | {header} |\n"
        f"|---|---|{'---|' * len(args.seals)}\n{rows}\n\n"
        f"Median per-round ratios; goal: each within {args.tolerance:.0%} of 1: "
        f"**{'met' if summary['met'] else 'not met'}**."
    )


if __name__ == "__main__":
    sys.exit(main())
