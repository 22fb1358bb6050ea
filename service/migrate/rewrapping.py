"""The migration pipeline: read pages ahead, rewrap them concurrently, commit them in order.

One thread (the caller's) reads pages from the source and commits them; ``concurrency``
worker threads send pages to the service. Pages are committed strictly in source order, so
the checkpoint is always one position with everything before it done and nothing after it
written. A stop (Ctrl-C, SIGTERM) reads no further page, commits the pages already at the
service and writes a clean checkpoint; a second signal ends the process at once, which is
still safe (see :mod:`.checkpoint`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import CheckpointFile, Snapshot, State
from .failures import FailureLog
from .ids import encode_id
from .model import FAIL_CHANGED, Counts, Kind, Outcome, Page, RunStopped
from .sampling import Sampler
from .service import BatchResult, Rewrapper
from .source import Source

MAX_LISTED_FAILURES = 20
GROUP_ROWS = 5000  # at most this many rows (whole pages) in one transaction


@dataclass(frozen=True, slots=True)
class Options:
    batch_size: int = 500
    concurrency: int = 4
    dry_run: bool = False
    verify: int = 0  # rows to decrypt under both keys and compare


@dataclass(slots=True)
class Result:
    total: Counts  # over every run of this checkpoint
    run: Counts  # this run
    elapsed: float  # this run, seconds
    complete: bool  # the source was read to its end
    resumed: bool
    already_complete: bool = False
    pass_number: int = 1  # the pass over the source under this checkpoint
    stopped: str | None = None  # the signal that ended the run early
    error: str | None = None  # why the run could not go on (RunStopped)
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first few, this run

    @property
    def rate(self) -> float:
        return self.run.rows / self.elapsed if self.elapsed > 0 else 0.0


Progress = Callable[[int, Counts], None]


class Migration:
    def __init__(
        self,
        source: Source,
        rewrapper: Rewrapper,
        options: Options,
        *,
        checkpoint: CheckpointFile | None = None,
        failures: FailureLog | None = None,
        on_start: Callable[[int | None, Counts], Progress] | None = None,
    ) -> None:
        self.source = source
        self.rewrapper = rewrapper
        self.options = options
        self.checkpoint = checkpoint
        self.failures = failures
        self._on_start = on_start
        self._stop = threading.Event()
        self.stop_reason: str | None = None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> Result:
        state = self.checkpoint.load() if self.checkpoint is not None else None
        resumed = state is not None
        if state is None:
            state = State(Snapshot(None, Counts(), 0))
        if state.pending is not None:
            if self.source.landed(state.witness):
                state.committed = state.pending
            state.pending, state.witness = None, None
        if state.done:
            if not self.source.repeatable:
                total = state.committed.counts
                return Result(
                    total,
                    Counts(),
                    0.0,
                    True,
                    True,
                    already_complete=True,
                    pass_number=state.pass_number,
                )
            # The last pass completed, but rows written under the old key since (by writers not
            # yet switched, or rewritten between read and update) are found only by reading
            # again: a new pass from the first row, with fresh counts and failure log. Rows
            # already under the target key are recognised and skipped; nothing is done twice.
            state = State(Snapshot(None, Counts(), 0), pass_number=state.pass_number + 1)
            resumed = False
        dry = self.options.dry_run
        if self.failures is not None and not dry:
            self.failures.open(state.committed.failures_offset if resumed else None)
        remaining = self.source.start(state.committed.position)
        if not resumed and not dry and self.checkpoint is not None:
            # Before anything is written: a run killed from here on has a checkpoint to resume.
            state.committed = Snapshot(self.source.position(), Counts(), 0)
            self.checkpoint.save(state)
        progress = self._on_start(remaining, state.committed.counts) if self._on_start else None
        run = _Run(self, state, progress, remaining)
        try:
            run.pump()
        finally:
            if not dry and self.checkpoint is not None:
                state.done = run.complete and run.error is None
                self.checkpoint.save(state)
        return Result(
            state.committed.counts if not dry else run.counts,
            run.counts,
            time.monotonic() - run.started,
            run.complete,
            resumed,
            stopped=self.stop_reason if self.stopping else None,
            error=None if run.error is None else str(run.error),
            failures=run.listed,
            pass_number=state.pass_number,
        )


class _Run:
    """The state of one run of the pipeline."""

    def __init__(
        self, migration: Migration, state: State, progress: Progress | None, remaining: int | None
    ) -> None:
        self.m = migration
        self.state = state
        self.progress = progress
        self.counts = Counts()  # this run
        self.base = state.committed.counts.copy()
        self.started = time.monotonic()
        self.complete = False
        self.error: RunStopped | None = None
        self.listed: list[dict[str, Any]] = []
        verify = migration.options.verify - self.base.verified
        self.sampler = Sampler(verify, remaining) if verify > 0 else None

    def pump(self) -> None:
        options = self.m.options
        inflight: deque[tuple[Page, Future[BatchResult]]] = deque()
        # Pages read ahead: ``concurrency`` at the service and as many again queued behind
        # them, so the service stays busy while this thread writes a group back.
        ahead = 2 * options.concurrency
        exhausted = False
        with ThreadPoolExecutor(options.concurrency, thread_name_prefix="rewrap") as pool:
            try:
                while True:
                    while not exhausted and not self.m.stopping and len(inflight) < ahead:
                        try:
                            page = self.m.source.read(options.batch_size)
                        except RunStopped as exc:
                            self.error = exc
                            page = None
                        if page is None:
                            exhausted = True
                            break
                        future = pool.submit(self.m.rewrapper.process, page, self.sampler)
                        inflight.append((page, future))
                    if not inflight:
                        break
                    group = self._ready(inflight)
                    if group:
                        try:
                            self._commit(group)
                        except RunStopped as exc:
                            self.error = exc
                    if self.error is not None:
                        break
            finally:
                for _, pending in inflight:
                    pending.cancel()
        self.complete = exhausted and self.error is None and not self.m.stopping

    def _ready(
        self, inflight: deque[tuple[Page, Future[BatchResult]]]
    ) -> list[tuple[Page, BatchResult]]:
        """The next page (waiting for it) and the pages after it that are done already, up to
        GROUP_ROWS rows: written back in one transaction with one checkpoint, so a fast
        service is not held back by the fsyncs of one commit per page. A page that failed
        ends the group and sets ``error``."""
        group: list[tuple[Page, BatchResult]] = []
        rows = 0
        while inflight and (not group or inflight[0][1].done()) and rows < GROUP_ROWS:
            page, future = inflight[0]
            try:
                result = future.result()
            except RunStopped as exc:
                self.error = exc
                break
            except Exception as exc:  # a bug: stop with the checkpoint consistent
                self.error = RunStopped(f"unexpected {type(exc).__name__}: {exc}")
                break
            inflight.popleft()
            group.append((page, result))
            rows += len(page)
        return group

    def _commit(self, group: list[tuple[Page, BatchResult]]) -> None:
        if self.m.options.dry_run:
            for page, result in group:
                self._account(page, result.outcomes, result.verified)
            return
        changes = [
            [(i, o.token) for i, o in enumerate(result.outcomes) if o.token is not None]
            for _, result in group
        ]

        def written(conflicts: Sequence[tuple[int, int]], witness: Any) -> None:
            for number, index in conflicts:
                group[number][1].outcomes[index] = Outcome.failed(
                    FAIL_CHANGED, "the row changed after it was read; left as it is"
                )
            entries = [e for page, r in group for e in self._failures(page, r.outcomes)]
            log = self.m.failures
            offset = log.append(entries) if log is not None else 0
            counts = self.state.committed.counts.copy()
            for _, result in group:
                counts.add(result.outcomes)
                counts.verified += result.verified
            counts.elapsed = self.base.elapsed + time.monotonic() - self.started
            snapshot = Snapshot(group[-1][0].end, counts, offset)
            if witness is None:
                self.state.committed = snapshot
            else:  # durable only with the commit that follows: saved as pending
                self.state.pending, self.state.witness = snapshot, witness
            if self.m.checkpoint is not None:
                self.m.checkpoint.save(self.state)

        pages = [
            (page, page_changes) for (page, _), page_changes in zip(group, changes, strict=True)
        ]
        self.m.source.write(pages, written)
        if self.state.pending is not None:  # the commit returned: it landed
            self.state.committed = self.state.pending
            self.state.pending, self.state.witness = None, None
        for page, result in group:
            self._account(page, result.outcomes, result.verified)

    def _failures(self, page: Page, outcomes: list[Outcome]) -> list[dict[str, Any]]:
        entries = [
            {"id": encode_id(ident), "reason": outcome.reason, "message": outcome.message}
            for ident, outcome in zip(page.ids, outcomes, strict=True)
            if outcome.kind is Kind.FAILED
        ]
        room = MAX_LISTED_FAILURES - len(self.listed)
        if room > 0:
            self.listed.extend(entries[:room])
        return entries

    def _account(self, page: Page, outcomes: list[Outcome], verified: int) -> None:
        self.counts.add(outcomes)
        self.counts.verified += verified
        self.counts.elapsed = time.monotonic() - self.started
        if self.m.options.dry_run:
            self._failures(page, outcomes)
        if self.progress is not None:
            self.progress(len(page), self.counts)
