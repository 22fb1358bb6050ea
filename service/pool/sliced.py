"""Sliced executor: costly calls on the event loop, a bounded slice of each loop iteration.

A private-key operation (RSA-2048 sign ~0.6 ms) is cheapest on the loop itself: no hand-off,
no second thread taking turns with the loop for the GIL and the core (in the thread pool the
same signature costs ~35 % more CPU, docs/EXECUTORS.md). But run there one after another, a
stream of them holds the loop and every cheap request queues behind them. This executor runs
them on the loop with at most ``budget`` seconds of such work per loop iteration: once the
iteration's slice is spent, later calls wait, in arrival order, for the next iteration, and
the cheap requests that became ready meanwhile are served in between. Under a steady mix the
core is shared about ``budget`` to the cheap work one iteration brings.

Backpressure as in the other kinds: at most ``max_pending`` calls waiting or running (past
that ``run()`` raises :class:`Overloaded` at once), and a call still waiting at its deadline
is dropped with :class:`Overloaded`. A running call is never interrupted: one item longer than
the budget still runs whole, and the slice is then spent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from service.errors import Overloaded
from service.pool.base import ExecutorKind, P, PoolStats, QueueWaitObserver, T
from service.pool.inline import InlineExecutor
from service.pool.queued import Lifecycle, check_deadline

log = logging.getLogger("cryptd.pool")

DEFAULT_BUDGET = 0.004  # seconds of sliced work per loop iteration (docs/EXECUTORS.md)

_Waiter = tuple[asyncio.Future[None], float]  # (future, loop time its deadline passes at)


class SlicedExecutor(InlineExecutor):
    """``initializer(*initargs)`` runs once, on the loop, in start() (the inline kind's)."""

    def __init__(
        self,
        *,
        budget: float = DEFAULT_BUDGET,
        max_pending: int = 2048,
        deadline: float = 5.0,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        on_queue_wait: QueueWaitObserver | None = None,
    ) -> None:
        super().__init__(
            max_pending=max_pending,
            deadline=deadline,
            initializer=initializer,
            initargs=initargs,
            on_queue_wait=on_queue_wait,
        )
        check_deadline(budget)
        self._budget = budget
        self._deadline = deadline
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._spent = 0.0  # sliced seconds run in the current iteration
        self._mean = 0.0  # moving mean of one call's seconds, to size what one slice wakes
        self._granted = 0  # calls woken for this slice, not yet started
        self._reset_scheduled = False
        self._drained: asyncio.Event | None = None  # set by close(): told when nothing is left
        self._expired_total = 0

    @property
    def kind(self) -> ExecutorKind:
        return "sliced"

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(self._deadline, fn, *args, **kwargs)

    async def run_with_deadline(
        self, deadline: float, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        check_deadline(deadline)
        return await self._run(deadline, fn, *args, **kwargs)

    def stats(self) -> PoolStats:
        return PoolStats(
            kind="sliced",
            workers=1,
            workers_alive=1 if self._lifecycle is Lifecycle.RUNNING else 0,
            queued=len(self._waiting),
            in_flight=self._in_flight,
            max_pending=self._max_pending,
            crashes_total=0,
            completed_total=self._completed_total,
            rejected_total=self._rejected_total,
            expired_total=self._expired_total,
        )

    async def close(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 (the interface's)
        """Refuse new calls; the waiting ones still run (each within its deadline)."""
        if self._lifecycle is Lifecycle.RUNNING:
            self._lifecycle = Lifecycle.CLOSING
        if self._pending():
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)
        self._lifecycle = Lifecycle.CLOSED

    # -- internals ----------------------------------------------------------------------------

    async def _run(
        self, deadline: float, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        if self._lifecycle is not Lifecycle.RUNNING:
            if self._lifecycle is Lifecycle.NEW:
                raise RuntimeError("executor not started")
            self._rejected_total += 1
            raise Overloaded("service is shutting down", retry_after=1.0)
        waited = 0.0
        if self._waiting or self._granted or self._slice_full():
            try:
                waited = await self._wait_for_slice(deadline)
            except BaseException:
                self._note_done()
                raise
        self._observe_wait(waited)
        self._in_flight += 1
        started = perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = perf_counter() - started
            self._in_flight -= 1
            self._completed_total += 1
            self._spent += elapsed
            self._mean = elapsed if not self._mean else 0.9 * self._mean + 0.1 * elapsed
            self._schedule_reset()
            self._note_done()

    def _pending(self) -> int:
        """Calls admitted and not finished: waiting (not expired or cancelled) or woken."""
        return sum(not future.done() for future, _ in self._waiting) + self._granted

    def _note_done(self) -> None:
        if self._drained is not None and not self._pending():
            self._drained.set()

    async def _wait_for_slice(self, deadline: float) -> float:
        """Queue for a later iteration's slice; the seconds waited."""
        if len(self._waiting) + self._in_flight >= self._max_pending:
            self._rejected_total += 1
            retry = max(1.0, min(30.0, len(self._waiting) * self._mean))
            raise Overloaded("too many operations waiting", retry_after=retry)
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((future, queued_at + deadline))
        self._schedule_reset()
        timer = loop.call_later(deadline, self._expire, future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._granted -= 1  # woken, then cancelled before it ran: the grant is unused
            raise
        finally:
            timer.cancel()
        self._granted -= 1
        return loop.time() - queued_at

    def _expire(self, future: asyncio.Future[None]) -> None:
        if not future.done():
            self._expired_total += 1
            future.set_exception(Overloaded("deadline exceeded before the task started"))

    def _schedule_reset(self) -> None:
        # call_soon from within an iteration runs at the start of the next one.
        if not self._reset_scheduled:
            self._reset_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_slice)

    def _slice_full(self) -> bool:
        """Whether this iteration's slice is spent: something ran in it already and one more
        call, at the mean cost, would pass the budget."""
        return self._spent > 0 and self._spent + self._mean > self._budget

    def _next_slice(self) -> None:
        """A new iteration: the slice is whole again; wake as many waiting calls as it holds
        at the mean cost of one, at least one."""
        self._reset_scheduled = False
        self._spent = 0.0
        room = max(1, int(self._budget / self._mean)) if self._mean > 0 else 1
        room -= self._granted
        waiting = self._waiting
        now = asyncio.get_running_loop().time()
        while waiting and room > 0:
            future, expires_at = waiting.popleft()
            if future.done():  # expired or cancelled while waiting
                continue
            if now >= expires_at:  # its timer is due but has not run yet: it must not start
                self._expire(future)
                continue
            future.set_result(None)
            self._granted += 1
            room -= 1
        if waiting:
            self._schedule_reset()
