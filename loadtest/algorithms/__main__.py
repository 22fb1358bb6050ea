"""``python -m loadtest.algorithms``: what ``cryptd bench`` runs. Same options (declared once, by
the ``cryptd bench`` command); prints the table, or JSON, and draws the chart when asked."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import orjson

from loadtest.algorithms import rates
from loadtest.algorithms.table import TITLES, rate_label, render
from service.cli.bench import add_arguments, check


def _progress(result: rates.Result) -> None:
    where = f" {result.payload} B" if result.payload is not None else ""
    threads = f" x{result.threads} threads" if result.threads > 1 else ""
    rate = rate_label(result.ops_per_s)
    print(f"  {result.backend} {result.operation}{where}{threads}: {rate}/s", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.algorithms", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check(args)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:  # an optional dependency the options need is missing
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    report = rates.run(
        seconds=args.seconds,
        sizes=rates.DEFAULT_SIZES if args.sizes is None else args.sizes,
        threads=args.threads,
        with_gmssl=not args.no_gmssl,
        rounds=args.rounds,
        progress=_progress if args.verbose else None,
        classic=not args.pq_only,
        post_quantum=not args.no_pq,
    )
    if args.json:
        sys.stdout.write(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(report))
    if args.chart is not None:
        from loadtest.charts import algorithms_chart

        print(f"chart: {algorithms_chart(report, args.chart, TITLES)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
