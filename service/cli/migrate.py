"""``cryptd migrate``: re-encrypt stored ciphertexts from one key to another (batch rewrap).

The work is in :mod:`service.migrate`; this module parses the command line, builds the parts
and turns the outcome into a report and an exit status. Its libraries (SQLAlchemy, psycopg,
tqdm) come with the optional ``cryptd[migrate]`` extra and are imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from service.cli.call import default_credential

EXIT_FAILED_ROWS = 1
EXIT_STOPPED = 3
_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="re-encrypt stored ciphertexts under another key (batch rewrap, resumable)",
        description="Re-encrypt the tokens of a SQL table column or of a JSONL/CSV file from "
        "--from-key to --to-key through the service's batch rewrap: the plaintext never "
        "reaches this tool. Rows already under the target key are skipped; a row that fails "
        "is reported and left as it was. With --checkpoint a killed run resumes where it "
        "stopped, and once a table's run is complete the same command starts a new pass that "
        "migrates rows written under --from-key since. Exit status: 0 done, 1 done with failed "
        "rows, 2 refused before starting, 3 stopped by an error (resume with the same "
        "command), 130/143 interrupted.",
    )
    parser.add_argument("--from-key", required=True, help="the key the tokens are under now")
    parser.add_argument("--to-key", required=True, help="the key to re-encrypt them under")

    sql = parser.add_argument_group("SQL table")
    sql.add_argument("--url", help="SQLAlchemy database URL (sqlite:///f.db, postgresql://...)")
    sql.add_argument("--table", help="table name (schema.table allowed)")
    sql.add_argument("--id-column", help="unique, orderable id column (rows go in its order)")
    sql.add_argument(
        "--writer",
        help="how updates are sent: sqlite | postgresql | pg-executemany | generic "
        "(default: the fastest for the database)",
    )

    files = parser.add_argument_group("JSONL / CSV file")
    files.add_argument("--input", type=Path, help="the file to read (never changed)")
    files.add_argument(
        "--format", choices=("jsonl", "csv"), help="default: from the file name's suffix"
    )
    files.add_argument("--out", type=Path, help="where the migrated file is written")
    files.add_argument("--delimiter", default=",", help="CSV field delimiter (default ',')")

    what = parser.add_argument_group("the token and its associated data")
    what.add_argument(
        "--column",
        "--field",
        dest="column",
        required=True,
        help="the column (SQL, CSV) or top-level JSON field (JSONL) that holds the token",
    )
    what.add_argument(
        "--aad-column",
        "--aad-field",
        dest="aad_column",
        help="column or field holding each row's associated data (text as UTF-8)",
    )

    run = parser.add_argument_group("the run")
    run.add_argument("--batch-size", type=int, default=500, help="rows per request and commit")
    run.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    run.add_argument("--checkpoint", type=Path, help="resume state (created, then kept up to date)")
    run.add_argument(
        "--failures",
        type=Path,
        help="JSON lines, one per failed row (default: <checkpoint>.failures.jsonl)",
    )
    run.add_argument("--dry-run", action="store_true", help="rewrap and report; write nothing")
    run.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="N",
        help="decrypt N sampled rows under both keys and compare (needs decrypt on both)",
    )
    run.add_argument("--credential", type=Path, help="client.json (default: the dev client's)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    run.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_migrate)


def _source(args: argparse.Namespace) -> Any:
    if (args.url is None) == (args.input is None):
        raise ValueError("give a table (--url, --table, --id-column) or a file (--input)")
    if args.url is not None:
        if not args.table or not args.id_column:
            raise ValueError("a SQL source needs --table and --id-column")
        from service.migrate.sql import SqlSource

        return SqlSource(
            args.url, args.table, args.column, args.id_column, args.aad_column, writer=args.writer
        )
    from service.migrate.files import CsvSource, JsonlSource

    kind = args.format or {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}.get(
        args.input.suffix.lower()
    )
    if kind is None:
        raise ValueError(f"cannot tell the format of {args.input}: give --format jsonl|csv")
    options = {"aad_field": args.aad_column, "dry_run": args.dry_run}
    if kind == "csv":
        return CsvSource(args.input, args.column, args.out, delimiter=args.delimiter, **options)
    return JsonlSource(args.input, args.column, args.out, **options)


def _migrate(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.concurrency < 1 or args.verify < 0:
        raise ValueError("--batch-size and --concurrency must be at least 1, --verify >= 0")
    try:
        import sqlalchemy  # noqa: F401
        import tqdm  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"cryptd migrate needs {exc.name}: pip install 'cryptd[migrate]'"
        ) from None
    from cryptd_client import CryptdClient

    credential = args.credential or default_credential()

    # RSA pages take seconds under load; past a few retries the tool halves a request the
    # service cannot finish in time rather than sending it again whole.
    client = CryptdClient.from_file(credential, timeout=120.0, retries=4, max_total_wait=60.0)
    with client:
        return _run(args, client)


def _run(args: argparse.Namespace, client: Any) -> int:
    from service.migrate.checkpoint import CheckpointFile
    from service.migrate.failures import FailureLog
    from service.migrate.progress import ProgressDisplay
    from service.migrate.report import Report
    from service.migrate.rewrapping import Migration, Options
    from service.migrate.service import Rewrapper, preflight

    source_key, target_key, warnings = preflight(client, args.from_key, args.to_key)
    for warning in warnings:
        print(f"cryptd migrate: warning: {warning}", file=sys.stderr)
    source = _source(args)
    rewrapper = Rewrapper(client, source_key, target_key)
    identity = source.identity()
    binding = {"source": identity, "from_key": args.from_key, "to_key": args.to_key}
    checkpoint = CheckpointFile(args.checkpoint, binding) if args.checkpoint else None
    failures_path = args.failures or (
        args.checkpoint.with_name(args.checkpoint.name + ".failures.jsonl")
        if args.checkpoint
        else None
    )
    failures = FailureLog(failures_path) if failures_path and not args.dry_run else None
    display = ProgressDisplay("off" if args.no_progress else "auto")
    options = Options(args.batch_size, args.concurrency, args.dry_run, args.verify)
    migration = Migration(
        source,
        rewrapper,
        options,
        checkpoint=checkpoint,
        failures=failures,
        on_start=display.start,
    )

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if migration.stopping:
            raise KeyboardInterrupt
        migration.request_stop(signal.Signals(signum).name)
        print(
            "\ncryptd migrate: stopping after the pages in flight (again to quit at once)",
            file=sys.stderr,
        )

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = migration.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        display.close()
        source.close()
        if failures is not None:
            failures.close()
    shown = failures_path if failures is not None else None
    report = Report(result, identity, (source_key, target_key), args.dry_run, shown)
    print(json.dumps(report.as_json()) if args.json else report.as_text())
    if result.error is not None:
        return EXIT_STOPPED
    if result.stopped is not None:
        return _SIGNAL_EXIT.get(result.stopped, EXIT_STOPPED)
    return EXIT_FAILED_ROWS if result.total.failed else 0
