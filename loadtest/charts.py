"""Charts (PNG) for the benchmarks: ``cryptd bench --chart`` (ops/s per algorithm; the
post-quantum key types against the classical ones, ops/s and bytes) and the load-test report
(cryptd against OpenBao per scenario, throughput and P99).

``python -m loadtest.run --chart FILE.png`` draws the load-test chart after a run;
``python -m loadtest.charts RESULTS.json FILE.png`` draws it again from a saved run.

matplotlib is an optional extra (``pip install 'cryptd[charts]'``); it is imported when a
chart is drawn. Drawing uses the non-interactive Agg backend, so it needs no display.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.algorithms import pq, rates
from loadtest.algorithms.table import size_label, type_title
from service.cli.bench import require_charts

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Series = Mapping[str, Sequence[float | None]]

# One colour per series name, the same in every chart (colour-blind safe, Okabe-Ito).
_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


class ChartsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def figure(rows: int, columns: int = 1, *, width: float = 11.0, height: float = 4.2) -> Figure:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise ChartsUnavailable("charts need matplotlib: pip install 'cryptd[charts]'") from None
    fig = Figure(figsize=(width, height * rows), layout="constrained")
    fig.subplots(rows, columns, squeeze=False)
    return fig


def grouped_bars(
    ax: Axes,
    categories: Sequence[str],
    series: Series,
    *,
    title: str,
    ylabel: str,
    log: bool = False,
    labels: bool = True,
) -> None:
    """One group of bars per category, one bar per series; a missing value (None) leaves a
    gap. With ``labels`` each bar carries its value."""
    names = list(series)
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        values = [math.nan if v is None else float(v) for v in series[name]]
        positions = [c + (index - (len(names) - 1) / 2) * width for c in range(len(categories))]
        bars = ax.bar(positions, values, width, label=name, color=_PALETTE[index % len(_PALETTE)])
        if labels:
            ax.bar_label(
                bars, labels=[_short(v) for v in values], fontsize=7, padding=2, rotation=90
            )
    ax.set_xticks(range(len(categories)), categories)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.25)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncols=min(len(names), 5))


def _short(value: float) -> str:
    if math.isnan(value):
        return ""
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.3g}"


def save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def algorithms_chart(report: rates.Report, path: str | Path, titles: Mapping[str, str]) -> Path:
    """``cryptd bench``: the post-quantum key types against the classical ones (ops/s per
    operation, then bytes), ops/s per operation for each algorithm of the SM2 table (SM2
    against RSA-2048 and the others), then the service's hybrid encrypt / decrypt by payload
    size (SM2 against RSA); each part when the report has it."""
    backends = [b for b in rates.BACKENDS if any(r.backend == b for r in report.results)]
    sizes = sorted({r.payload for r in report.results if r.payload is not None})
    pq_rows = 3 if report.sizes else 0
    fig = figure(pq_rows + (1 if backends else 0) + (1 if sizes else 0))
    every: Any = fig.axes
    if pq_rows:
        _pq_rows(report, every[:pq_rows])
    axes = every[pq_rows:]
    meta = report.meta
    fig.suptitle(
        f"cryptd bench: Python {meta['python']}, {meta.get('pyca', '')}; SM2: "
        f"{meta['libcrypto']}; {meta['machine']}, {meta['cpus']} CPUs",
        fontsize=10,
    )
    if not backends:
        return save(fig, path)
    grouped_bars(
        axes[0],
        list(rates.OPERATIONS),
        {titles[b]: [report.rate(b, op) for op in rates.OPERATIONS] for b in backends},
        title=f"Operations per second, one thread ({rates.KEY_PAYLOAD}-byte payloads; "
        "log scale, higher is better)",
        ylabel="ops/s",
        log=True,
    )
    if sizes:
        categories = [f"{op} {size_label(size)}" for size in sizes for op in ("encrypt", "decrypt")]
        hybrid = [b for b in ("sm2-hybrid", "rsa-2048-hybrid") if b in _present(report)]
        grouped_bars(
            axes[1],
            categories,
            {
                titles[b]: [
                    report.rate(b, op, size) for size in sizes for op in ("encrypt", "decrypt")
                ]
                for b in hybrid
            },
            title="The service's encryption by payload size: SM2 (SM4-GCM data key) "
            "against RSA-2048 (AES-256-GCM data key)",
            ylabel="ops/s",
        )
        axes[1].tick_params(axis="x", labelrotation=30, labelsize=8)
    return save(fig, path)


def _pq_rows(report: rates.Report, axes: Sequence[Axes]) -> None:
    """ML-DSA against the classical signatures, ML-KEM and X-Wing against RSA-2048 and SM2
    encryption (ops/s per operation, one bar per key type), then the bytes of each."""

    def measured(names: Sequence[str], operations: Sequence[str]) -> list[str]:
        return [n for n in names if any(report.rate(pq.label(n), op) for op in operations)]

    def rate(name: str, operation: str) -> float | None:
        return report.rate(name if name == pq.REFERENCE else pq.label(name), operation)

    signing = measured(pq.SIGNING, pq.SIGN_OPERATIONS)
    if report.rate(pq.REFERENCE, "sign") is not None:
        signing.append(pq.REFERENCE)
    grouped_bars(
        axes[0],
        list(pq.SIGN_OPERATIONS),
        {type_title(n): [rate(n, op) for op in pq.SIGN_OPERATIONS] for n in signing},
        title="Signatures through cryptd's key handles: ops/s of a 32-byte message, one thread "
        "(log scale, higher is better)",
        ylabel="ops/s",
        log=True,
    )
    encrypting = measured(pq.ENCRYPTING, pq.ENCRYPT_OPERATIONS)
    grouped_bars(
        axes[1],
        list(pq.ENCRYPT_OPERATIONS),
        {type_title(n): [rate(n, op) for op in pq.ENCRYPT_OPERATIONS] for n in encrypting},
        title=f"Encryption of a {pq.DATA_KEY_BYTES}-byte data key (the service's token) and raw "
        "KEM: ops/s, one thread (log scale; RSA and SM2 have no KEM)",
        ylabel="ops/s",
        log=True,
    )
    names = list(dict.fromkeys([*signing, *encrypting]))
    names = [n for n in names if n in report.sizes]
    labels = {
        "signature": "signature",
        "ciphertext": f"ciphertext of a {pq.DATA_KEY_BYTES}-byte data key",
        "encapsulation": "KEM ciphertext",
    }
    grouped_bars(
        axes[2],
        [type_title(n) for n in names],
        {labels[kind]: [report.sizes[n].get(kind) for n in names] for kind in pq.SIZES},
        title="Bytes on the wire (log scale, lower is better)",
        ylabel="bytes",
        log=True,
    )
    axes[2].tick_params(axis="x", labelsize=8)


def _present(report: rates.Report) -> set[str]:
    return {r.backend for r in report.results}


def comparison_chart(results: dict[str, Any], path: str | Path) -> Path:
    """``results`` is the runner's JSON (its ``comparisons`` and ``case_study``)."""
    rows = results["comparisons"]
    titles = [_wrap(row["title"]) for row in rows]
    bao = [row.get("openbao") or {} for row in rows]
    fig = figure(2, height=4.6)
    top, bottom = fig.axes
    grouped_bars(
        top,
        titles,
        {
            "cryptd": [row["cryptd"]["ops"] for row in rows],
            "OpenBao Transit": [b.get("ops") for b in bao],
        },
        title="Throughput (operations per second; batch: items per second; higher is better)",
        ylabel="ops/s",
        log=True,
    )
    p99_titles = list(titles)
    p99 = {
        "cryptd": [row["cryptd"]["p99_ms"] for row in rows],
        "OpenBao Transit": [b.get("p99_ms") for b in bao],
    }
    case = results.get("case_study")
    if case:
        p99_titles.append(_wrap(f"case study: RSA decrypt at {case['rate']:,.0f} req/s offered"))
        p99["cryptd"].append(case["cryptd"].get("p99_ms"))
        p99["OpenBao Transit"].append((case.get("openbao") or {}).get("p99_ms"))
    grouped_bars(
        bottom,
        p99_titles,
        p99,
        title="P99 latency (ms, log scale; lower is better)",
        ylabel="ms",
        log=True,
    )
    for ax in (top, bottom):
        ax.tick_params(axis="x", labelsize=8)
    config = results.get("config", {})
    fig.suptitle(
        f"cryptd against OpenBao Transit, {results.get('started', '')}: "
        f"{config.get('connections', '?')} connections, {config.get('duration', '?')} s x "
        f"{config.get('rounds', '?')} rounds (medians), cryptd with "
        f"{config.get('workers', '?')} worker(s)",
        fontsize=10,
    )
    return save(fig, path)


def _wrap(title: str, width: int = 18) -> str:
    words, lines, line = title.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path, help="a runner JSON file (loadtest/results/...)")
    parser.add_argument("chart", type=Path, help="PNG to write")
    args = parser.parse_args(argv)
    try:
        require_charts("drawing a chart")
    except OSError as exc:
        parser.error(str(exc))
    comparison_chart(json.loads(args.results.read_text()), args.chart)
    print(args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
