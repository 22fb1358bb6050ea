"""Where a cryptd request's CPU goes under load (``python -m loadtest.profile SCENARIO``).

Starts cryptd (1 server worker unless told otherwise), drives one scenario with the signing wrk
script, samples the server with py-spy (``pip install py-spy``) meanwhile, and prints the
functions by inclusive and self share of the samples, converted to microseconds per request
with the server CPU time per request measured in the same run. ``--collapsed FILE`` keeps the
raw stacks (flame-graph input); ``--module-prefix`` groups by module instead of function.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from loadtest.measure import Measurement
from loadtest.plan import Plan
from loadtest.sampling import measure as measure_target
from loadtest.sampling import prepare
from loadtest.scenarios import BY_NAME
from loadtest.targets import Cryptd


def parse_collapsed(text: str) -> tuple[Counter[str], Counter[str], int]:
    """(inclusive, self, total) sample counts per frame from py-spy's raw output."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(frame) for frame in stack.split(";")]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    return inclusive, own, total


def _short(frame: str) -> str:
    # "name (path/to/module.py:123)" -> "name (module.py)"; thread names pass through.
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    tail = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({tail})"


def report(
    inclusive: Counter[str], own: Counter[str], total: int, us_per_request: float, top: int
) -> str:
    lines = [
        f"{total} samples; {us_per_request:.0f} us server CPU per request "
        "(us/request = share x that; with --gil the samples cover Python work only)",
        "",
    ]
    for title, counter in (("inclusive", inclusive), ("self", own)):
        lines.append(f"| {title} | share | us/request |")
        lines.append("|---|---:|---:|")
        for frame, count in counter.most_common(top):
            share = count / total
            lines.append(f"| {frame} | {share:.1%} | {share * us_per_request:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(BY_NAME))
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--all-threads",
        dest="gil",
        action="store_false",
        help="sample every thread (default: only the one holding the GIL, i.e. Python work;"
        " py-spy counts some blocked pool threads as busy)",
    )
    parser.add_argument("--collapsed", type=Path, help="keep py-spy's raw stacks here")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    scenario = BY_NAME[args.scenario]
    plan = Plan.of_scenarios(
        (scenario.name,), duration=args.duration, rounds=1, warmup=2.0, connections=args.connections
    )
    with tempfile.TemporaryDirectory(prefix="cryptd-profile-") as tmp:
        cryptd = Cryptd(Path(tmp) / "cryptd", args.workers)
        cryptd.start()
        try:
            prepared = prepare([cryptd], [scenario], Path(tmp) / "bodies")
            measure_target(cryptd, scenario, prepared, plan, plan.warmup)
            out = Path(tmp) / "stacks.txt"
            spy = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(cryptd.pid),
                    "--subprocesses",
                    *(["--gil"] if args.gil else ["--threads"]),
                    "--rate",
                    str(args.rate),
                    "--duration",
                    str(round(args.duration)),
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            result: list[Measurement] = []
            worker = threading.Thread(
                target=lambda: result.append(
                    measure_target(cryptd, scenario, prepared, plan, args.duration)
                )
            )
            worker.start()
            worker.join()
            _, errors = spy.communicate(timeout=60)
            if spy.returncode != 0 or not out.exists():
                print(f"py-spy failed: {errors.decode(errors='replace')}", file=sys.stderr)
                return 1
            text = out.read_text()
        finally:
            cryptd.stop()
    m = result[0]
    if args.collapsed:
        args.collapsed.write_text(text)
    us = (m.server_cpu_s or 0) / m.requests * 1e6 if m.requests else 0.0
    print(
        f"{scenario.title}: {m.ops:,.0f} ops/s, P50 {m.p50_ms:.2f} ms, P99 {m.p99_ms:.2f} ms "
        f"(under py-spy), errors {m.errors}"
    )
    inclusive, own, total = parse_collapsed(text)
    print(report(inclusive, own, total, us, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
