"""The final report: migrated, skipped, failed with reasons, throughput; text or JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rewrapping import Result
from .service import KeyInfo


def _reasons(counter: Counter[str]) -> str:
    if not counter:
        return ""
    return "  (" + ", ".join(f"{k} {v:,}" for k, v in sorted(counter.items())) + ")"


def status(result: Result) -> str:
    if result.error is not None:
        return "stopped"
    if result.stopped is not None:
        return "interrupted"
    return "complete" if result.complete else "incomplete"


@dataclass(frozen=True)
class Report:
    """One run's report: ``source`` as the source describes itself, ``keys`` (from, to),
    ``failures`` the file the failed rows went to (None: not kept)."""

    result: Result
    source: dict[str, Any]
    keys: tuple[KeyInfo, KeyInfo]
    dry_run: bool
    failures: Path | None

    def as_json(self) -> dict[str, Any]:
        result, keys, failures = self.result, self.keys, self.failures
        return {
            "status": status(result),
            "dry_run": self.dry_run,
            "resumed": result.resumed,
            "pass": result.pass_number,
            "error": result.error,
            "signal": result.stopped,
            "source": self.source,
            "from_key": keys[0].name,
            "to_key": keys[1].name,
            "total": {**result.total.to_json(), "rows": result.total.rows},
            "run": {
                **result.run.to_json(),
                "rows": result.run.rows,
                "rows_per_second": round(result.rate, 1),
            },
            "failures_file": None if failures is None else str(failures),
            "first_failures": result.failures,
        }

    def as_text(self) -> str:
        result, source, keys, dry_run = self.result, self.source, self.keys, self.dry_run
        total, run = result.total, result.run
        would = "would be " if dry_run else ""
        where = source.get("url") or source.get("path")
        what = source.get("table") or source.get("kind")
        lines = [
            f"cryptd migrate: {status(result)}{' (dry run: nothing written)' if dry_run else ''}",
            f"  source      {where} {what} {source.get('column') or source.get('field')}",
            f"  keys        {keys[0].label} -> {keys[1].label}",
        ]
        if result.already_complete:
            lines.append("  (the checkpoint says this migration is complete; nothing was read)")
        elif result.pass_number > 1:
            n = result.pass_number
            lines.append(f"  pass        {n}: the table read again after the complete pass {n - 1}")
        lines += [
            f"  migrated    {total.migrated:,} {would}".rstrip(),
            f"  skipped     {total.skipped.total():,}{_reasons(total.skipped)}",
            f"  failed      {total.failed.total():,}{_reasons(total.failed)}",
        ]
        if total.verified:
            lines.append(
                f"  verified    {total.verified:,} rows decrypted under both keys "
                f"({total.failed.get('verify_mismatch', 0):,} differed)"
            )
        if result.resumed and not result.already_complete:
            lines.append(f"  this run    {run.rows:,} rows (the rest in earlier runs)")
        lines.append(
            f"  throughput  {run.rows:,} rows in {result.elapsed:.1f} s: {result.rate:,.0f} rows/s"
        )
        if total.failed and self.failures is not None:
            lines.append(f"  failures    listed in {self.failures}")
        for entry in result.failures[:10]:
            lines.append(f"    id {entry['id']}: {entry['reason']}: {entry['message']}")
        if result.error is not None:
            lines.append(f"  error       {result.error}")
            lines.append("  everything committed is in the checkpoint: fix the cause and run the")
            lines.append("  same command again to resume")
        elif result.stopped is not None:
            lines.append(f"  stopped by {result.stopped}: run the same command again to resume")
        return "\n".join(lines)
