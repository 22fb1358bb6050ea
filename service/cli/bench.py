"""``cryptd bench``: SM2 against RSA-2048, ECDSA-P256, Ed25519 and gmssl on this machine.

Prints the origin article's table (keygen, encrypt, decrypt, sign, verify in ops/s on one core,
with SM2/RSA-2048 and SM2/gmssl ratios), the effect of the payload size, the SM2 speed-up on
several threads and SM2 against its references; ``--json`` gives the same figures as JSON,
``--chart FILE.png`` draws them (the ``charts`` extra).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import orjson

from service import bench

_TITLES = {
    "sm2": "SM2",
    "rsa-2048": "RSA-2048",
    "ecdsa-p256": "ECDSA-P256",
    "ed25519": "Ed25519",
    "gmssl": "gmssl",
    "sm2-hybrid": "SM2 hybrid",
    "rsa-2048-hybrid": "RSA hybrid",
    "sm2-raw": "SM2 raw",
    "gmssl-raw": "gmssl raw",
}


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _size(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    first, rest = cells[0].ljust(widths[0]), cells[1:]
    return first + "".join(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))


def render(report: bench.Report) -> str:
    meta = report.meta
    lines = [
        f"cryptd bench: ops/s, one thread, {report.seconds:g} s per figure "
        f"(Python {meta['python']}, {meta['libcrypto']}, {meta['machine']}, "
        f"{meta['cpus']} CPUs)",
        "",
    ]
    backends = [b for b in bench.BACKENDS if any(r.backend == b for r in report.results)]
    widths = [16] + [12] * len(backends) + [14, 11]
    header = ["operation", *(_TITLES[b] for b in backends), "SM2/RSA-2048", "SM2/gmssl"]
    lines.append(_row(header, widths))
    ratios = bench.ratios(report)
    for operation in bench.OPERATIONS:
        label = operation
        if operation in ("encrypt", "decrypt"):
            label = f"{operation} {bench.KEY_PAYLOAD} B"
        cells = [label, *(_rate(report.rate(b, operation)) for b in backends)]
        cells += [_times(ratios[operation]["sm2/rsa-2048"]), _times(ratios[operation]["sm2/gmssl"])]
        lines.append(_row(cells, widths))

    sizes = sorted({r.payload for r in report.results if r.payload is not None})
    if sizes:
        lines += [
            "",
            "payload size (ops/s); hybrid = the service's encrypt, raw = SM2 of the payload",
        ]
        payload_backends = [
            b for b in bench.PAYLOAD_BACKENDS if any(r.backend == b for r in report.results)
        ]
        widths = [10, 9] + [13] * len(payload_backends) + [14, 16]
        header = ["payload", "op", *(_TITLES[b] for b in payload_backends)]
        lines.append(_row([*header, "SM2/RSA hyb", "SM2/gmssl raw"], widths))
        for size in sizes:
            for operation in ("encrypt", "decrypt"):
                rates = {b: report.rate(b, operation, size) for b in payload_backends}
                cells = [_size(size), operation, *(_rate(rates[b]) for b in payload_backends)]
                cells.append(_times(bench.ratio(rates["sm2-hybrid"], rates["rsa-2048-hybrid"])))
                cells.append(_times(bench.ratio(rates["sm2-raw"], rates.get("gmssl-raw"))))
                lines.append(_row(cells, widths))

    threaded = [r for r in report.results if r.threads > 1]
    if threaded:
        lines += [
            "",
            f"SM2 on 1 and {threaded[0].threads} threads (libcrypto runs without the GIL)",
        ]
        for r in threaded:
            single = report.rate(bench.THREADS, r.operation)
            speedup = _times(bench.ratio(r.ops_per_s, single))
            lines.append(
                f"  {r.operation:<8} {_rate(single):>8}/s -> {_rate(r.ops_per_s):>8}/s ({speedup})"
            )

    lines += [
        "",
        "SM2 against the pure-Python gmssl and against RSA-2048's private-key operation "
        "(PSS signing, measured alongside)",
    ]
    for row in bench.goals(report):
        lines.append(
            f"  {row['operation']:<8} {_rate(row['sm2']):>8}/s"
            f"  {_times(row['vs_gmssl']):>8} gmssl"
            f"  {_times(row['vs_rsa_private']):>6} RSA-2048 private ({_rate(row['rsa_private'])}/s)"
        )
    return "\n".join(lines) + "\n"


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("sizes are comma-separated byte counts") from None
    if any(size < 1 or size > 1 << 20 for size in sizes):
        raise argparse.ArgumentTypeError("each size must be between 1 and 1048576 bytes")
    return sizes


def _progress(result: bench.Result) -> None:
    where = f" {result.payload} B" if result.payload is not None else ""
    threads = f" x{result.threads} threads" if result.threads > 1 else ""
    print(
        f"  {result.backend} {result.operation}{where}{threads}: {_rate(result.ops_per_s)}/s",
        file=sys.stderr,
    )


def handle(args: argparse.Namespace) -> int:
    if args.seconds <= 0:
        raise ValueError("--seconds must be positive")
    if args.rounds < 1 or args.threads < 1:
        raise ValueError("--rounds and --threads must be at least 1")
    report = bench.run(
        seconds=args.seconds,
        sizes=args.sizes,
        threads=args.threads,
        with_gmssl=not args.no_gmssl,
        rounds=args.rounds,
        progress=_progress if args.verbose else None,
    )
    if args.json:
        sys.stdout.write(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(report))
    if args.chart is not None:
        from service.charts import bench_chart

        print(f"chart: {bench_chart(report, args.chart, _TITLES)}", file=sys.stderr)
    if args.check:
        return (
            0
            if all(g["gmssl_met"] is not False and g["rsa_met"] for g in bench.goals(report))
            else 1
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure SM2 against RSA-2048, ECDSA-P256, Ed25519 and gmssl on this machine",
        description=__doc__,
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="time per figure (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=list(bench.DEFAULT_SIZES),
        help="payload sizes in bytes, comma-separated (default: 16,128,1024,8192)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="also run SM2 on this many threads (default: 2; 1 skips)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="slices per figure, alternating with its rivals (default: 3)",
    )
    parser.add_argument("--no-gmssl", action="store_true", help="skip the gmssl reference")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when an SM2 operation is below 10x gmssl or below RSA-2048's private-key rate",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        metavar="FILE.png",
        help="also draw the figures as a PNG chart (needs the charts extra: matplotlib)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each figure on stderr")
    parser.set_defaults(func=handle)
