"""Command-line options the load-test commands share (``loadtest.run``, ``loadtest.tls``): the
load, the topology, the wait for a quiet machine and the outputs; and the command a result
reports, which measures the same again."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Final

# Where a run writes its figures changes nothing it measures: left out of the command it reports.
_OUTPUT_OPTIONS: Final = ("--json", "--markdown", "--chart")
_OUTPUT_FLAGS: Final = ("--record",)


def add_load_options(parser: argparse.ArgumentParser, quick: str) -> None:
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--duration", type=float, help="seconds per measurement (10; quick 3)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (3; quick 1)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (1)")


def add_topology_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="servers and load generators on the same cores (default with two CPUs or more:"
        " pinned, load generators on the first half of the CPUs, servers on the rest)",
    )
    parser.add_argument("--client-cpus", help="CPUs of the load generators, e.g. 0 or 0-1")
    parser.add_argument("--server-cpus", help="CPUs of every server, e.g. 1 or 2-3")


def add_quiet_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        help="before each measurement wait until other processes use at most this many cores"
        " (0.25; 0 = never wait)",
    )
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="longest wait, s (120)")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="JSON output (default loadtest/results/...)")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument(
        "--record",
        action="store_true",
        help="also write the run's summary to docs/results/DATE-KIND.md (what docs/PERFORMANCE.md"
        " quotes)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory")


def add_cryptd_env_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--cryptd-env",
        type=env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for every cryptd server (repeatable), e.g."
        ' CRYPTD_EXECUTORS=\'{"rsa-2048":"thread"}\'',
    )


def reproduce_command(module: str, argv: Sequence[str]) -> str:
    """``python -m MODULE ARGS``: the command that measures the same again, without the
    options that only name output files."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _OUTPUT_OPTIONS:
            skip = True
        elif arg not in _OUTPUT_FLAGS and not arg.startswith(
            tuple(f"{o}=" for o in _OUTPUT_OPTIONS)
        ):
            kept.append(arg)
    return " ".join(["python", "-m", module, *kept])


def env_pair(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (NAME, VALUE): one variable of a cryptd server's environment."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value
