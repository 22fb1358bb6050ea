"""The load-test report's chart (PNG): cryptd against OpenBao per scenario, throughput and P99.

Drawn with :mod:`service.charts` (matplotlib, the ``charts`` extra). ``python -m loadtest.run
--chart FILE.png`` draws it after a run; ``python -m loadtest.chart RESULTS.json FILE.png``
draws it again from a saved run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.charts import figure, grouped_bars, save


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
    comparison_chart(json.loads(args.results.read_text()), args.chart)
    print(args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
