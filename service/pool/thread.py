"""Thread executor: ``workers`` threads fed from the bounded queue.

Right for work that releases the GIL (pyca/cryptography's RSA and EC private-key operations,
libcrypto through cffi): no pickling, shared key cache. The loop hands a job to a thread only when
one is idle, so "started" means a thread really began it and the deadline rule holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from service.pool.base import Call, ExecutorKind, QueueWaitObserver, WorkerStartError
from service.pool.queued import Job, Lifecycle, QueuedExecutor, as_task_error

# What a thread takes: the call and what to do with its outcome (on the loop); None = stop.
_Item = tuple[Call, Callable[[object, BaseException | None], None]] | None


class ThreadExecutor(QueuedExecutor[Call]):
    """``initializer(*initargs)`` runs once, on a pool thread, before start() returns: threads
    share the process, so one load of the keyring serves them all."""

    def __init__(
        self,
        *,
        workers: int,
        max_pending: int,
        deadline: float,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        on_queue_wait: QueueWaitObserver | None = None,
        name: str = "cryptd-pool",
    ) -> None:
        super().__init__(
            workers=workers, max_pending=max_pending, deadline=deadline, on_queue_wait=on_queue_wait
        )
        self._initializer = initializer
        self._initargs = initargs
        self._name = name
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._live_threads = 0
        self._all_stopped = asyncio.Event()
        self._side_calls = 0  # broadcast/initializer calls occupying a thread

    @property
    def kind(self) -> ExecutorKind:
        return "thread"

    async def broadcast(self, fn: Callable[[], object]) -> None:
        """Threads share one process: ``fn`` runs once, on a pool thread."""
        if self._lifecycle is not Lifecycle.RUNNING:
            if self._lifecycle in (Lifecycle.NEW, Lifecycle.STARTING):
                raise RuntimeError("executor not started")
            return  # closing: nothing left to update
        await self._side_call(fn)

    # -- QueuedExecutor hooks -----------------------------------------------------------------

    def _encode(
        self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> Call:
        return (fn, args, kwargs)

    def _has_idle_worker(self) -> bool:
        return len(self._active) + self._side_calls < len(self._threads)

    def _start_job(self, job: Job[Call]) -> None:
        assert job.payload is not None
        self._queue.put((job.payload, lambda result, exc: self._job_done(job, result, exc)))

    def _workers_alive(self) -> int:
        return sum(1 for t in self._threads if t.is_alive())

    def _crashes_total(self) -> int:
        return 0

    async def _start_workers(self) -> None:
        loop = self._running_loop()
        for index in range(self._workers):
            thread = threading.Thread(
                target=_thread_main,
                args=(self._queue, loop, self._thread_stopped),
                name=f"{self._name}-{index}",
                daemon=True,  # a task stuck in C code must not keep the interpreter alive
            )
            thread.start()
            self._threads.append(thread)
            self._live_threads += 1
        if self._initializer is None:
            return
        initializer, initargs = self._initializer, self._initargs
        try:
            await self._side_call(lambda: initializer(*initargs))
        except Exception as exc:
            await self._stop_workers(drained=True)
            raise WorkerStartError(f"pool initializer failed ({type(exc).__name__})") from None

    async def _stop_workers(self, *, drained: bool) -> None:
        for _ in self._threads:
            self._queue.put(None)
        if drained and self._side_calls == 0:
            # Every thread is idle: each takes its None and exits at once.
            await self._all_stopped.wait()
            for thread in self._threads:
                thread.join()  # past its last line already: returns at once
            self._threads = []
            return
        # close() timed out: a thread still in C code runs a task nobody waits for; it is a
        # daemon thread and exits after that task, without blocking the loop here.
        self._threads = [t for t in self._threads if t.is_alive()]

    def _thread_stopped(self) -> None:
        self._live_threads -= 1
        if self._live_threads == 0:
            self._all_stopped.set()

    # -- internals ------------------------------------------------------------------------------

    def _job_done(self, job: Job[Call], result: object, exc: BaseException | None) -> None:
        if job.id not in self._active:
            return  # failed by a timed-out close(); the thread finished late
        self._finish(job, exc if exc is not None else lambda: result)
        self._pump()

    async def _side_call(self, fn: Callable[[], object]) -> None:
        loop = self._running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish(_result: object, exc: BaseException | None) -> None:
            self._side_calls -= 1
            if not done.done():
                if exc is None:
                    done.set_result(None)
                else:
                    done.set_exception(as_task_error(exc))
            self._pump()

        self._side_calls += 1
        self._queue.put(((fn, (), {}), finish))
        await done


def _thread_main(
    items: queue.SimpleQueue[_Item],
    loop: asyncio.AbstractEventLoop,
    on_stop: Callable[[], None],
) -> None:
    try:
        _serve(items, loop)
    finally:
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(on_stop)


def _serve(items: queue.SimpleQueue[_Item], loop: asyncio.AbstractEventLoop) -> None:
    while (item := items.get()) is not None:
        (fn, args, kwargs), report = item
        result: object = None
        error: BaseException | None = None
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # delivered to the caller, never printed here
            error = exc
        del item, fn, args, kwargs  # do not keep the arguments alive while idle
        try:
            loop.call_soon_threadsafe(report, result, error)
        except RuntimeError:
            return  # the loop is closed: nobody is waiting any more
        del result, error, report
