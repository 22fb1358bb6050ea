"""Sliced executor: costly calls on the event loop, sharing it with the cheap requests.

A private-key operation (RSA-2048 sign ~0.4 ms) is cheapest on the loop itself: no hand-off,
no second thread taking turns with the loop for the GIL and the core (in the thread pool the
same signature costs ~35 % more CPU, docs/EXECUTORS.md). But run there one after another, a
stream of them holds the loop and every cheap request queues behind them. Here a call runs
only while the executor has *credit*, seconds of loop time it may use; a call's time is taken
from it, and calls that find none wait, in arrival order, for a later loop iteration. How
much credit there is depends on the cheap requests (:class:`InFlight`), those that never
wait for this executor:

- While one is in progress, every second spent otherwise earns ``share / (1 - share)``
  seconds, up to one call's mean cost: calls take about ``share`` of the time, one at a time
  between the cheap requests' steps, so a cheap request meets at most one call in each loop
  iteration it crosses, and fewer the smaller the share. Time counts whether the loop ran
  something else or waited (a cheap request waiting for Redis): a call waiting for credit is
  woken by a timer, so the loop sleeps instead of spinning.
- When none is in progress but one ended in the last ``grace`` seconds, its client is likely
  about to send the next: one call per loop iteration, so a request arriving meanwhile waits
  for one call at most.
- Otherwise nothing else needs the loop: calls run back to back, at most ``budget`` seconds
  of them per loop iteration.

Backpressure as in the other kinds: at most ``max_pending`` calls waiting or running (past
that ``run()`` raises :class:`Overloaded` at once), and a call still waiting at its deadline
is dropped with :class:`Overloaded`. A running call is never interrupted: one item longer than
the credit still runs whole, and the executor is then in debt.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from service.defaults import DEFAULT_BUDGET as DEFAULT_BUDGET
from service.defaults import DEFAULT_SHARE as DEFAULT_SHARE
from service.errors import Overloaded
from service.pool.base import ExecutorKind, P, QueueWaitObserver, T
from service.pool.inline import InlineExecutor
from service.pool.queued import Lifecycle, check_deadline

log = logging.getLogger("cryptd.pool")

DEFAULT_GRACE = 0.003  # seconds cheap work counts as in progress after a request ends

_Waiter = tuple[asyncio.Future[None], float]  # (future, loop time its deadline passes at)


class InFlight:
    """The cheap requests a sliced executor yields to: whoever runs them calls ``start()``
    when one begins and ``end()`` when it is over."""

    __slots__ = ("count", "grace", "last_end")

    def __init__(self, grace: float = DEFAULT_GRACE) -> None:
        self.count = 0
        self.grace = grace  # seconds a request's client counts as about to send the next
        self.last_end = -grace

    def start(self) -> None:
        self.count += 1

    def end(self, now: float | None = None) -> None:
        """``now``: the caller's ``perf_counter()`` reading, if it has one."""
        self.count -= 1
        self.last_end = perf_counter() if now is None else now

    def recent(self, now: float) -> bool:
        """Whether one ended less than ``grace`` seconds before ``now``."""
        return now - self.last_end < self.grace


class SlicedExecutor(InlineExecutor):
    """``initializer(*initargs)`` runs once, on the loop, in start() (the inline kind's)."""

    def __init__(
        self,
        *,
        budget: float = DEFAULT_BUDGET,
        share: float = DEFAULT_SHARE,
        cheap: InFlight | None = None,
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
        if not 0.0 < share < 1.0:
            raise ValueError("share must be between 0 and 1")
        self._budget = budget
        self._rate = share / (1.0 - share)  # credit earned per second of other work
        self._cheap = cheap or InFlight()
        self._deadline = deadline
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._credit = budget  # seconds of loop time calls may still take
        self._mark = perf_counter()  # when the credit was last brought up to date
        self._spent = 0.0  # seconds calls ran since then
        self._mean = 0.0  # moving mean of one call's seconds, to size what one slice wakes
        self._granted = 0  # calls woken for this slice, not yet started
        self._reset_scheduled = False
        self._drained: asyncio.Event | None = None  # set by close(): told when nothing is left

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

    def _queued(self) -> int:
        return len(self._waiting)

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
        if self._waiting or self._granted or not self._has_credit():
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
            self._credit -= elapsed
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

    def _refill(self, *, new_iteration: bool) -> bool:
        """Bring the credit up to date (see the module's docstring); whether a cheap request
        is in progress."""
        now = perf_counter()
        other = now - self._mark - self._spent
        self._mark = now
        self._spent = 0.0
        if self._cheap.count > 0:
            # At most one call's worth: calls go one at a time between the cheap steps.
            cap = self._fit() if self._mean > 0.0 else self._budget
            self._credit = min(cap, self._credit + max(0.0, other) * self._rate)
            return True
        if self._mean > 0.0 and self._cheap.recent(now):
            fit = self._fit()  # one call per iteration
            self._credit = fit if new_iteration else min(self._credit, fit)
        elif new_iteration:
            self._credit = self._budget
        return False

    def _fit(self) -> float:
        """The credit a call needs to start: its mean cost, at most a whole budget."""
        return min(self._mean, self._budget)

    def _has_credit(self) -> bool:
        self._refill(new_iteration=False)
        return self._credit > 0.0 and self._credit >= self._fit()

    def _next_slice(self) -> None:
        """A new iteration: wake as many waiting calls as the credit holds at the mean cost of
        one; with none measured yet, one."""
        self._reset_scheduled = False
        busy = self._refill(new_iteration=True)
        fit = self._fit()
        room = self._credit - self._granted * self._mean
        waiting = self._waiting
        now = asyncio.get_running_loop().time()
        while waiting and room > 0.0 and room >= fit:
            future, expires_at = waiting.popleft()
            if future.done():  # expired or cancelled while waiting
                continue
            if now >= expires_at:  # its timer is due but has not run yet: it must not start
                self._expire(future)
                continue
            future.set_result(None)
            self._granted += 1
            if self._mean == 0.0:
                break
            room -= self._mean
        if not waiting:
            return
        if self._granted or not busy:
            self._schedule_reset()  # the next iteration: those run, or new credit
            return
        # Cheap work in progress and no credit for one more call: wake again once that work
        # has earned it, as a timer (the loop sleeps if nothing else is ready, not spins).
        self._reset_scheduled = True
        asyncio.get_running_loop().call_later((fit - room) / self._rate, self._next_slice)
