"""The bounded queue shared by the thread and process executors.

Admission, deadlines, queue-wait observation and draining live here, on the event loop; a
subclass only says whether a worker is idle and how to hand it a job. Expired and cancelled jobs
leave the queue at once, so the queue never holds more than ``max_pending`` entries.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from service.errors import Internal, Overloaded
from service.pool.base import ExecutorKind, P, PoolStats, QueueWaitObserver, T

log = logging.getLogger("cryptd.pool")

PayloadT = TypeVar("PayloadT")

MAX_ATTEMPTS = 2
"""A job whose worker died is retried once (crypto operations are idempotent)."""

_RETRY_AFTER_MAX = 30.0
_EWMA_WEIGHT = 0.1


class JobState(enum.Enum):
    QUEUED = enum.auto()
    RUNNING = enum.auto()
    DONE = enum.auto()


class Lifecycle(enum.Enum):
    NEW = enum.auto()
    STARTING = enum.auto()
    RUNNING = enum.auto()
    CLOSING = enum.auto()
    CLOSED = enum.auto()


@dataclass(eq=False, slots=True)
class Job(Generic[PayloadT]):
    id: int
    payload: PayloadT | None
    future: asyncio.Future[Any]
    enqueued_at: float
    expires_at: float
    started_at: float = 0.0
    attempts: int = 0
    state: JobState = field(default=JobState.QUEUED)


def check_limits(workers: int, max_pending: int, deadline: float) -> None:
    if workers < 1:
        raise ValueError("workers must be at least 1")
    if max_pending < 1:
        raise ValueError("max_pending must be at least 1")
    check_deadline(deadline)


def check_deadline(deadline: float) -> None:
    if not (deadline > 0 and math.isfinite(deadline)):
        raise ValueError("deadline must be a positive number of seconds")


class QueuedExecutor(ABC, Generic[PayloadT]):
    """Base of the executors whose workers take one job at a time from a bounded queue."""

    def __init__(
        self,
        *,
        workers: int,
        max_pending: int,
        deadline: float,
        on_queue_wait: QueueWaitObserver | None = None,
    ) -> None:
        check_limits(workers, max_pending, deadline)
        self._workers = workers
        self._max_pending = max_pending
        self._deadline = deadline
        self._on_queue_wait = on_queue_wait
        self._lifecycle = Lifecycle.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: OrderedDict[int, Job[PayloadT]] = OrderedDict()
        self._active: dict[int, Job[PayloadT]] = {}
        self._ids = itertools.count(1)
        self._drained: asyncio.Future[None] | None = None
        self._closed: asyncio.Event | None = None
        self._service_time = 0.0
        self._completed_total = 0
        self._rejected_total = 0
        self._expired_total = 0

    # -- what a subclass provides -------------------------------------------------------------

    @property
    @abstractmethod
    def kind(self) -> ExecutorKind: ...

    @abstractmethod
    def _encode(
        self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> PayloadT:
        """Turn a call into what a worker receives (runs in the caller, before admission)."""

    @abstractmethod
    def _has_idle_worker(self) -> bool: ...

    @abstractmethod
    def _start_job(self, job: Job[PayloadT]) -> None:
        """Hand ``job`` to an idle worker. Must not raise."""

    @abstractmethod
    def _workers_alive(self) -> int: ...

    @abstractmethod
    def _crashes_total(self) -> int: ...

    @abstractmethod
    async def _start_workers(self) -> None: ...

    @abstractmethod
    async def _stop_workers(self, *, drained: bool) -> None:
        """Stop every worker. ``drained`` is false when close() timed out: jobs still running
        have been failed already and nobody waits for them."""

    # -- public interface ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._lifecycle is not Lifecycle.NEW:
            raise RuntimeError("executor already started")
        self._loop = asyncio.get_running_loop()
        self._lifecycle = Lifecycle.STARTING
        try:
            await self._start_workers()
        except BaseException:
            self._lifecycle = Lifecycle.CLOSED
            raise
        self._lifecycle = Lifecycle.RUNNING

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._submit(self._deadline, fn, args, kwargs)

    async def run_with_deadline(
        self, deadline: float, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        check_deadline(deadline)
        return await self._submit(deadline, fn, args, kwargs)

    def stats(self) -> PoolStats:
        return PoolStats(
            kind=self.kind,
            workers=self._workers,
            workers_alive=self._workers_alive(),
            queued=len(self._pending),
            in_flight=len(self._active),
            max_pending=self._max_pending,
            crashes_total=self._crashes_total(),
            completed_total=self._completed_total,
            rejected_total=self._rejected_total,
            expired_total=self._expired_total,
        )

    async def close(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 (the interface's)
        if self._lifecycle is Lifecycle.NEW:
            self._lifecycle = Lifecycle.CLOSED
            return
        if self._lifecycle in (Lifecycle.CLOSING, Lifecycle.CLOSED):
            if self._closed is not None:
                await self._closed.wait()
            return
        if self._lifecycle is Lifecycle.STARTING:
            raise RuntimeError("close() called while start() is running")
        loop = self._running_loop()
        self._lifecycle = Lifecycle.CLOSING
        self._closed = asyncio.Event()
        self._drained = loop.create_future()
        self._settle()
        drained = True
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._drained)
        except TimeoutError:
            drained = False
            log.warning(
                "executor close: %d queued and %d running tasks not drained in %.1f s",
                len(self._pending),
                len(self._active),
                timeout,
            )
        self._fail_leftovers()
        try:
            await self._stop_workers(drained=drained)
        finally:
            self._lifecycle = Lifecycle.CLOSED
            self._closed.set()

    # -- submission, deadlines ----------------------------------------------------------------

    async def _submit(
        self,
        deadline: float,
        fn: Callable[..., T],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> T:
        if self._lifecycle is not Lifecycle.RUNNING:
            if self._lifecycle in (Lifecycle.NEW, Lifecycle.STARTING):
                raise RuntimeError("executor not started")
            self._rejected_total += 1
            raise Overloaded("service is shutting down", retry_after=1.0)
        if len(self._pending) + len(self._active) >= self._max_pending:
            self._rejected_total += 1
            raise Overloaded(retry_after=self._retry_after())
        payload = self._encode(fn, args, kwargs)
        loop = self._running_loop()
        now = loop.time()
        job: Job[PayloadT] = Job(
            next(self._ids), payload, loop.create_future(), now, now + deadline
        )
        timer = loop.call_at(job.expires_at, self._expire, job)
        self._pending[job.id] = job
        self._pump()
        try:
            return cast(T, await job.future)
        finally:
            timer.cancel()
            if job.state is JobState.QUEUED:
                # The caller was cancelled (client went away) before a worker took the job.
                self._pending.pop(job.id, None)
                job.state = JobState.DONE
                job.payload = None
                self._settle()

    def _expire(self, job: Job[PayloadT]) -> None:
        if job.future.done():
            return
        self._expired_total += 1
        retry_after = self._retry_after()
        if job.state is JobState.QUEUED:
            self._pending.pop(job.id, None)
            job.state = JobState.DONE
            job.payload = None
            job.future.set_exception(
                Overloaded("deadline exceeded before the task started", retry_after=retry_after)
            )
            self._settle()
        else:
            # Running: C code cannot be interrupted; the late result will be discarded.
            job.future.set_exception(Overloaded("deadline exceeded", retry_after=retry_after))

    def _retry_after(self) -> float:
        """Seconds until the current backlog should have drained, from the mean task time."""
        backlog = len(self._pending) + len(self._active)
        seconds = backlog * self._service_time / max(1, self._workers_alive())
        return min(_RETRY_AFTER_MAX, max(1.0, float(math.ceil(seconds))))

    # -- moving jobs ----------------------------------------------------------------------------

    def _pump(self) -> None:
        """Start queued jobs while workers are idle; then see whether close() may finish."""
        loop = self._running_loop()
        while self._pending and self._has_idle_worker():
            _, job = self._pending.popitem(last=False)
            if job.future.done():  # cancelled; its run() has not resumed yet
                job.state = JobState.DONE
                job.payload = None
                continue
            now = loop.time()
            if now >= job.expires_at:  # its timer has not fired yet
                self._expire(job)
                continue
            job.state = JobState.RUNNING
            job.started_at = now
            job.attempts += 1
            self._active[job.id] = job
            self._observe_wait(now - job.enqueued_at)
            self._start_job(job)
        self._settle()

    def _observe_wait(self, seconds: float) -> None:
        if self._on_queue_wait is None:
            return
        try:
            self._on_queue_wait(seconds)
        except Exception as exc:  # a metrics bug must not break the pool
            log.warning("on_queue_wait observer raised %s", type(exc).__name__)

    def _finish(self, job: Job[PayloadT], outcome: Callable[[], object] | BaseException) -> None:
        """A worker finished ``job``: deliver its result unless the caller has given up.

        ``outcome`` is the exception the callable raised, or a thunk that returns the result
        (decoding is skipped for a result nobody will read).
        """
        self._active.pop(job.id, None)
        job.state = JobState.DONE
        job.payload = None
        self._completed_total += 1
        elapsed = self._running_loop().time() - job.started_at
        self._service_time += _EWMA_WEIGHT * (elapsed - self._service_time)
        if job.future.done():
            return
        if isinstance(outcome, BaseException):
            job.future.set_exception(as_task_error(outcome))
            return
        try:
            result = outcome()
        except Exception as exc:
            job.future.set_exception(as_task_error(exc))
        else:
            job.future.set_result(result)

    def _lost(self, job: Job[PayloadT]) -> None:
        """The worker running ``job`` died: run it once more elsewhere, else fail it."""
        self._active.pop(job.id, None)
        if job.future.done():
            job.state = JobState.DONE
            job.payload = None
        elif job.attempts < MAX_ATTEMPTS:
            job.state = JobState.QUEUED
            job.enqueued_at = self._running_loop().time()
            self._pending[job.id] = job
            self._pending.move_to_end(job.id, last=False)
        else:
            job.state = JobState.DONE
            job.payload = None
            job.future.set_exception(Internal("worker process died"))

    def _fail_leftovers(self) -> None:
        """close() timed out: callers still waiting get Overloaded before the workers stop."""
        leftovers = [*self._pending.values(), *self._active.values()]
        self._pending.clear()
        self._active.clear()
        for job in leftovers:
            job.state = JobState.DONE
            job.payload = None
            if not job.future.done():
                job.future.set_exception(Overloaded("service is shutting down", retry_after=1.0))

    def _settle(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done() and not self._pending and not self._active:
            drained.set_result(None)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("executor not started")
        return self._loop


def as_task_error(exc: BaseException) -> BaseException:
    """What a caller may receive: exceptions pass through; interpreter-level ones do not."""
    if isinstance(exc, Exception):
        return exc
    # SystemExit, KeyboardInterrupt, GeneratorExit from a task must not unwind the event loop.
    return Internal("task exited abnormally")
