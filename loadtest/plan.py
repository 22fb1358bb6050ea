"""What a load-test run does and where: the scenarios, durations and rounds (:class:`Plan`)
and the pinned topology (load generators and servers on separate CPUs, :class:`Topology`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Final

from loadtest.scenarios import BY_NAME, DEFAULT_SCENARIOS, GROUPS, MIX_BY_NAME

CALIBRATION_DEFAULT: Final = tuple(
    name for name in DEFAULT_SCENARIOS if BY_NAME[name].openbao is not None
)
CALIBRATION_QUICK: Final = ("aes-encrypt", "rsa-sign")


@dataclass(frozen=True)
class Topology:
    """Where the load generators and the servers run. Pinned (the default with two CPUs or
    more): the runner, wrk and the open-loop generator on ``client``, every server (cryptd and
    its Redis, OpenBao, the bare-ASGI ceiling) on ``server``, OpenBao with GOMAXPROCS equal to
    their number. Shared: everything anywhere (``--shared-cores``)."""

    pinned: bool
    client: frozenset[int]
    server: frozenset[int]

    @property
    def server_cpus(self) -> frozenset[int] | None:
        return self.server if self.pinned else None

    @property
    def server_cores(self) -> int:
        """The cores the servers may use: what ops per server core divides by."""
        return len(self.server)

    def summary(self) -> str:
        if not self.pinned:
            return f"shared cores: servers and load generators on the same {len(self.server)}"
        return (
            f"pinned: load generators on CPU {_cpu_list(self.client)}, "
            f"servers on CPU {_cpu_list(self.server)}"
        )


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _parse_cpus(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def make_topology(args: argparse.Namespace) -> Topology:
    available = sorted(os.sched_getaffinity(0))
    if args.shared_cores or len(available) < 2:
        every = frozenset(available)
        return Topology(False, every, every)
    if args.server_cpus:
        server = _parse_cpus(args.server_cpus)
    else:
        # Half the CPUs each (the load generator gets the first ones): 1 + 1 on two.
        server = frozenset(available[len(available) // 2 :])
    client = _parse_cpus(args.client_cpus) if args.client_cpus else frozenset(available) - server
    if not client or not server or client & server:
        raise SystemExit("--client-cpus and --server-cpus must be disjoint and non-empty")
    if not (client | server) <= set(available):
        raise SystemExit(
            f"CPUs outside this process's affinity ({_cpu_list(frozenset(available))})"
        )
    return Topology(True, client, server)


UNPINNED = Topology(False, frozenset({0}), frozenset({0}))  # a plan's default: nothing pinned


@dataclass(frozen=True)
class Plan:
    duration: float
    rounds: int
    warmup: float
    connections: int
    threads: int
    case_rate: float
    case_duration: float
    calibration: float
    calibration_scenarios: tuple[str, ...]
    scenarios: tuple[str, ...]
    quiet_threshold: float = 0.0  # wait for the rest of the machine to use <= this many cores
    quiet_wait: float = 0.0  # ... for at most this many seconds (0: never wait)
    # wrk computes each cryptd body's Content-Digest once per thread (the body never changes;
    # nonce, created and HMAC stay per request); False: pure-Lua SHA-256 on every request.
    digest_once: bool = True
    topology: Topology = UNPINNED
    ceiling: bool = True  # measure the bare-ASGI ceiling beside aes-encrypt
    mixes: tuple[str, ...] = ()

    @classmethod
    def of_scenarios(
        cls,
        scenarios: tuple[str, ...],
        *,
        duration: float,
        rounds: int,
        warmup: float,
        connections: int,
        topology: Topology = UNPINNED,
    ) -> Plan:
        """A plan that only drives ``scenarios`` with wrk (one thread): no case study, no
        calibration, for the tools beside the runner."""
        return cls(
            duration=duration,
            rounds=rounds,
            warmup=warmup,
            connections=connections,
            threads=1,
            case_rate=0.0,
            case_duration=0.0,
            calibration=0.0,
            calibration_scenarios=(),
            scenarios=scenarios,
            topology=topology,
        )


def load_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The plan's fields every campaign command sets alike from the shared options
    (loadtest.options): durations, rounds, connections, the quiet wait and the topology."""
    quick = args.quick
    return {
        "duration": args.duration or (3.0 if quick else 10.0),
        "rounds": args.rounds or (1 if quick else 3),
        "warmup": 1.0 if quick else 2.0,
        "connections": args.connections,
        "threads": args.threads,
        "quiet_threshold": args.quiet,
        "quiet_wait": args.quiet_wait if args.quiet > 0 else 0.0,
        "topology": make_topology(args),
    }


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    if args.scenarios == "none":  # the case study alone
        chosen: tuple[str, ...] = ()
    else:
        named = args.scenarios.split(",") if args.scenarios else [*DEFAULT_SCENARIOS, *MIX_BY_NAME]
        # a group name (``pq``) stands for its scenarios
        chosen = tuple(dict.fromkeys(s for name in named for s in GROUPS.get(name, (name,))))
    unknown = [s for s in chosen if s not in BY_NAME and s not in MIX_BY_NAME]
    if unknown:
        known = ", ".join([*GROUPS, *BY_NAME, *MIX_BY_NAME])
        raise SystemExit(f"unknown scenarios: {', '.join(unknown)} (known: {known})")
    scenarios = tuple(s for s in chosen if s in BY_NAME)
    mixes = tuple(s for s in chosen if s in MIX_BY_NAME)
    return Plan(
        **load_settings(args),
        case_rate=args.case_rate,
        case_duration=args.case_duration or (5.0 if quick else 20.0),
        calibration=2.0 if quick else 3.0,
        calibration_scenarios=CALIBRATION_QUICK if quick else CALIBRATION_DEFAULT,
        scenarios=scenarios,
        digest_once=not args.digest_every_request,
        ceiling=not args.no_ceiling,
        mixes=mixes,
    )
