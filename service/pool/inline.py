"""Inline executor: runs the callable on the event loop itself.

For work cheaper than any hand-off (AES-GCM on a small message is microseconds, a thread round
trip is tens). Nothing ever queues: a call starts at once, so the deadline cannot be missed and
backpressure has nothing to bound; the stats still count the work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from service.errors import Overloaded
from service.pool.base import ExecutorKind, P, PoolStats, QueueWaitObserver, T, WorkerStartError
from service.pool.queued import Lifecycle, check_deadline, check_limits

log = logging.getLogger("cryptd.pool")


class InlineExecutor:
    """``initializer(*initargs)`` runs once, on the loop, in start()."""

    def __init__(
        self,
        *,
        max_pending: int = 1,
        deadline: float = 5.0,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        on_queue_wait: QueueWaitObserver | None = None,
    ) -> None:
        check_limits(1, max_pending, deadline)
        self._max_pending = max_pending
        self._initializer = initializer
        self._initargs = initargs
        self._on_queue_wait = on_queue_wait
        self._lifecycle = Lifecycle.NEW
        self._in_flight = 0
        self._completed_total = 0
        self._rejected_total = 0
        self._expired_total = 0  # a call starts at once: its deadline cannot pass

    @property
    def kind(self) -> ExecutorKind:
        return "inline"

    async def start(self) -> None:
        if self._lifecycle is not Lifecycle.NEW:
            raise RuntimeError("executor already started")
        if self._initializer is not None:
            try:
                self._initializer(*self._initargs)
            except Exception as exc:
                self._lifecycle = Lifecycle.CLOSED
                raise WorkerStartError(f"pool initializer failed ({type(exc).__name__})") from None
        self._lifecycle = Lifecycle.RUNNING

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._call(fn, *args, **kwargs)

    async def run_with_deadline(
        self, deadline: float, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        check_deadline(deadline)
        return self._call(fn, *args, **kwargs)

    async def broadcast(self, fn: Callable[[], object]) -> None:
        fn()

    def stats(self) -> PoolStats:
        return PoolStats(
            kind=self.kind,
            workers=1,
            workers_alive=1 if self._lifecycle is Lifecycle.RUNNING else 0,
            queued=self._queued(),
            in_flight=self._in_flight,
            max_pending=self._max_pending,
            crashes_total=0,
            completed_total=self._completed_total,
            rejected_total=self._rejected_total,
            expired_total=self._expired_total,
        )

    def _queued(self) -> int:
        return 0  # a call starts at once

    async def close(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 (the interface's)
        # Nothing can be in flight across an await: every call completes before run() returns.
        self._lifecycle = Lifecycle.CLOSED

    def _call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        if self._lifecycle is not Lifecycle.RUNNING:
            if self._lifecycle is Lifecycle.NEW:
                raise RuntimeError("executor not started")
            self._rejected_total += 1
            raise Overloaded("service is shutting down", retry_after=1.0)
        self._observe_wait(0.0)
        self._in_flight += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._in_flight -= 1
            self._completed_total += 1

    def _observe_wait(self, seconds: float) -> None:
        if self._on_queue_wait is not None:
            try:
                self._on_queue_wait(seconds)
            except Exception as exc:  # a metrics bug must not break the pool
                log.warning("on_queue_wait observer raised %s", type(exc).__name__)
