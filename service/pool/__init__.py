"""Executors for work that must not stall the event loop, with backpressure and deadlines.

Generic: nothing here knows about keys or HTTP. ``make_executor`` builds one of four kinds —
``inline`` (on the loop), ``sliced`` (on the loop, a bounded slice of each iteration),
``thread`` (a thread pool, for code that releases the GIL) or ``process`` (worker processes
that survive each other's death). See docs/EXECUTORS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.pool.base import (
    EXECUTOR_KINDS,
    Executor,
    ExecutorKind,
    P,
    PoolStats,
    QueueWaitObserver,
    T,
    WorkerStartError,
)
from service.pool.inline import InlineExecutor
from service.pool.process import ProcessExecutor
from service.pool.sliced import DEFAULT_BUDGET, DEFAULT_SHARE, InFlight, SlicedExecutor
from service.pool.thread import ThreadExecutor

__all__ = [
    "EXECUTOR_KINDS",
    "Executor",
    "ExecutorKind",
    "InFlight",
    "InlineExecutor",
    "PoolStats",
    "ProcessExecutor",
    "QueueWaitObserver",
    "SlicedExecutor",
    "ThreadExecutor",
    "WorkerStartError",
    "make_executor",
    "run_in_pool",
]


def make_executor(
    kind: ExecutorKind,
    *,
    workers: int,
    max_pending: int,
    deadline: float,
    initializer: Callable[..., object] | None = None,
    initargs: tuple[Any, ...] = (),
    on_queue_wait: QueueWaitObserver | None = None,
    slice_budget: float = DEFAULT_BUDGET,
    slice_share: float = DEFAULT_SHARE,
    cheap: InFlight | None = None,
) -> Executor:
    """Build an executor; call ``await executor.start()`` before use, ``close()`` after.
    The sliced kind's ``slice_budget`` (seconds of work per loop iteration when nothing else
    runs), ``slice_share`` (of the time while ``cheap`` requests are in progress)."""
    common: dict[str, Any] = {
        "max_pending": max_pending,
        "deadline": deadline,
        "initializer": initializer,
        "initargs": initargs,
        "on_queue_wait": on_queue_wait,
    }
    if kind == "inline":
        return InlineExecutor(**common)  # one loop: no worker count
    if kind == "sliced":
        return SlicedExecutor(budget=slice_budget, share=slice_share, cheap=cheap, **common)
    if kind == "thread":
        return ThreadExecutor(workers=workers, **common)
    if kind == "process":
        return ProcessExecutor(workers=workers, **common)
    raise ValueError(f"unknown executor kind {kind!r}; expected one of {EXECUTOR_KINDS}")


async def run_in_pool(
    executor: Executor, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
) -> T:
    """``await run_in_pool(pool, sign, key_id, items)`` reads like Starlette's run_in_threadpool."""
    return await executor.run(fn, *args, **kwargs)
