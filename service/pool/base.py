"""What every executor promises: the protocol, its statistics and its kinds.

An executor runs plain synchronous callables away from (or, for ``inline``, on) the event loop,
with backpressure: at most ``max_pending`` tasks are queued or running; past that ``run()``
raises :class:`service.errors.Overloaded` at once instead of queueing without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

from service.defaults import ExecutorKind as ExecutorKind

EXECUTOR_KINDS: tuple[ExecutorKind, ...] = ("inline", "sliced", "thread", "process")

P = ParamSpec("P")
T = TypeVar("T")

Call = tuple[Callable[..., object], tuple[object, ...], dict[str, object]]
"""A function call as data: (fn, args, kwargs)."""

QueueWaitObserver = Callable[[float], None]
"""Called with the seconds a task waited in the queue before a worker started it."""


class WorkerStartError(RuntimeError):
    """A worker could not start (its initializer failed or the process died while starting).

    The message names the exception type only: the initializer handles secrets (a keyring, a
    master key) and its error text could quote them.
    """


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot, read on the event loop. Counters only grow; gauges are instantaneous."""

    kind: ExecutorKind
    workers: int
    """Workers configured."""
    workers_alive: int
    """Workers started and ready to take work (a replacement counts once its initializer ran)."""
    queued: int
    """Tasks admitted and waiting for a worker."""
    in_flight: int
    """Tasks running on a worker, including ones whose caller already gave up at its deadline."""
    max_pending: int
    crashes_total: int
    """Worker processes that died without being asked to stop."""
    completed_total: int
    """Tasks that ran to completion (a result or an exception from the callable)."""
    rejected_total: int = 0
    """run() calls refused at once: queue full or executor closing."""
    expired_total: int = 0
    """Tasks whose caller got Overloaded at the deadline (dropped unstarted or result discarded)."""


class Executor(Protocol):
    """Runs synchronous callables with bounded queueing and a per-task deadline.

    ``run()`` raises :class:`service.errors.Overloaded` when the executor is full or closing
    (at once), or when the task's deadline passes (a task that has not started by then is
    dropped; one that has started runs to completion but its result is discarded). An exception
    raised by the callable reaches the caller unchanged (for ``process``: same type and message,
    without traceback; an exception that cannot cross the process boundary becomes
    :class:`service.errors.Internal` with a generic message).
    """

    @property
    def kind(self) -> ExecutorKind: ...

    async def start(self) -> None:
        """Start the workers and run the initializer; returns once every worker is ready."""

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` under the executor's default deadline."""

    async def run_with_deadline(
        self, deadline: float, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Like :meth:`run`, with this call's deadline in seconds from now."""

    async def broadcast(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once in every worker process (once in-process for inline and thread).

        Bypasses the queue and its limits. A worker that dies before running it counts as
        reached: its replacement runs the initializer, which loads current state.
        """

    def stats(self) -> PoolStats: ...

    async def close(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 (a drain budget)
        """Refuse new work, drain queued and running tasks (up to ``timeout``), stop workers."""
