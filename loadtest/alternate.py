"""Same-run comparisons of cryptd configurations: several servers started side by side on the
server CPUs of the pinned topology, wrk driving one scenario at each in turn, the order
alternating round by round so drift on the machine hits all alike. A configuration's figure
is the median over the rounds of its ratio to the reference's in the same round.

Used by loadtest/audit_cost.py (audit off against fail-closed) and loadtest/seal_parity.py
(static against pkcs11 and shamir); ``record`` writes the dated summary under docs/results/.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson

from loadtest import records
from loadtest.measure import Measurement, run_wrk
from loadtest.plan import Topology
from loadtest.scenarios import BY_NAME
from loadtest.targets import Cryptd, OpenBao


def per_core(measurement: Measurement, cores: int) -> float:
    if measurement.errors:
        raise RuntimeError(f"{measurement.errors} requests failed during a round")
    return measurement.requests / measurement.seconds / cores


def rounds(
    servers: Sequence[Cryptd | OpenBao],
    topology: Topology,
    count: int,
    *,
    duration: float,
    connections: int,
    scenario: str = "aes-encrypt",
    bodies: Mapping[str, Path] | None = None,
) -> list[dict[str, Measurement]]:
    """``count`` rounds of one measurement per server (started by the caller), in forward
    then reverse order; each round's measurements by server name. An OpenBao server takes its
    request body from ``bodies`` (by server name; loadtest.sampling.prepare makes them)."""
    if topology.pinned:
        os.sched_setaffinity(0, topology.client)  # wrk, our child, inherits it
    found: list[dict[str, Measurement]] = []
    for number in range(count):
        figures: dict[str, Measurement] = {}
        for server in servers if number % 2 == 0 else list(reversed(servers)):
            if isinstance(server, OpenBao):
                endpoint = BY_NAME[scenario].openbao
                if endpoint is None or bodies is None:
                    raise ValueError(f"no OpenBao request for {scenario} on {server.name}")
                script = "openbao.lua"
                args = [scenario, str(bodies[server.name]), endpoint.path]
                env = {"BAO_TOKEN": server.token}
            else:
                script, args = "cryptd.lua", [scenario]
                env = {"CRYPTD_CREDENTIALS": str(server.credentials)}
            figures[server.name] = run_wrk(
                script,
                server.url,
                args,
                connections=connections,
                duration=duration,
                env=env,
                server_pid=server.pid,
            )
        found.append(figures)
        shown = ", ".join(
            f"{name} {per_core(m, topology.server_cores):,.0f}/s" for name, m in figures.items()
        )
        print(f"round {number + 1}/{count}: {shown} per server core", file=sys.stderr)
    return found


def median_ratio(values: Sequence[float], reference: Sequence[float]) -> float:
    return statistics.median(
        v / r if r else float("nan") for v, r in zip(values, reference, strict=True)
    )


RESULTS_DIR = Path(__file__).resolve().parent / "results"


def stamp() -> str:
    """The run's UTC time as its reports name it."""
    return f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"


def publish(
    kind: str, summary: dict[str, object], text: str, when: str, out: Path | None, keep: bool
) -> Path:
    """The run's JSON as loadtest/results/KIND-WHEN.json (or ``out``), ``text`` printed and,
    with ``keep``, recorded under docs/results/ too."""
    out = out or RESULTS_DIR / f"{kind}-{when}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(text + f"\nreport: {out}")
    if keep:
        print(f"recorded {record(kind, text)}", file=sys.stderr)
    return out


def record(kind: str, text: str, when: dt.datetime | None = None) -> Path:
    """``text`` as docs/results/DATE-KIND.md (loadtest/records.py: a later run the same day
    gets its time added)."""
    return records.keep(kind, text, when or dt.datetime.now(dt.UTC))
