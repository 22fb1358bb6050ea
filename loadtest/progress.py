"""Progress lines on stderr, timestamped, and the one-line summary of a measurement."""

from __future__ import annotations

import sys
import time

from loadtest.measure import Measurement


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def describe(m: Measurement) -> str:
    return (
        f"{m.ops:,.0f} ops/s  P50 {m.p50_ms:.2f} ms  P99 {m.p99_ms:.2f} ms  errors {m.errors}"
        + (f"  others' CPU {m.others_cpu_s / m.seconds:.2f} cores" if m.others_cpu_s else "")
    )
