"""Progress on stderr: a tqdm bar (rate and ETA) on a terminal, a line every few seconds
otherwise (a job's log), nothing with ``--no-progress``."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from .model import Counts


def _tally(counts: Counts) -> str:
    skipped, failed = counts.skipped.total(), counts.failed.total()
    return f"migrated {counts.migrated:,} skipped {skipped:,} failed {failed:,}"


class ProgressDisplay:
    def __init__(self, mode: str = "auto", stream: TextIO | None = None, interval: float = 10.0):
        self._stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self._stream.isatty() else "log"
        self.mode = mode
        self._interval = interval
        self._bar: Any = None
        self._total: int | None = None
        self._done = 0
        self._started = 0.0
        self._last = 0.0

    def start(self, remaining: int | None, before: Counts) -> ProgressDisplay:
        self._total = remaining
        self._started = self._last = time.monotonic()
        if before.rows and self.mode != "off":
            print(f"resuming: {_tally(before)} before this run", file=self._stream)
        if self.mode == "bar":
            self._bar = tqdm(
                total=remaining,
                unit=" rows",
                unit_scale=True,
                dynamic_ncols=True,
                file=self._stream,
                smoothing=0.1,
                mininterval=0.5,
            )
        return self

    def __call__(self, rows: int, counts: Counts) -> None:
        self._done += rows
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"skipped {counts.skipped.total():,} failed {counts.failed.total():,}",
                refresh=False,
            )
            self._bar.update(rows)
        elif self.mode == "log":
            now = time.monotonic()
            if now - self._last >= self._interval:
                self._last = now
                meter = tqdm.format_meter(
                    self._done, self._total or 0, now - self._started, unit=" rows", unit_scale=True
                )
                print(f"{meter} | {_tally(counts)}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
