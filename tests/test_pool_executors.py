"""Inline and thread executors, and the factory. Real threads, no mocks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from service.errors import DecryptionFailed, Overloaded
from service.pool import (
    EXECUTOR_KINDS,
    InlineExecutor,
    ThreadExecutor,
    WorkerStartError,
    make_executor,
    run_in_pool,
)


def add(a: int, b: int, *, scale: int = 1) -> int:
    return (a + b) * scale


def fail_decrypt() -> None:
    raise DecryptionFailed()


def thread_name() -> str:
    return threading.current_thread().name


class Gate:
    """Lets a test hold pool threads busy and release them deterministically."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.release = threading.Event()
        self.entered = 0
        self.changed = asyncio.Event()
        self.ran: list[int] = []

    def hold(self, tag: int) -> int:
        self.ran.append(tag)
        self.loop.call_soon_threadsafe(self._note_entered)
        self.release.wait(10)
        return tag

    def _note_entered(self) -> None:
        self.entered += 1
        self.changed.set()

    async def wait_entered(self, count: int) -> None:
        while self.entered < count:
            self.changed.clear()
            await self.changed.wait()


@pytest_asyncio.fixture(loop_scope="function")
async def pool() -> AsyncIterator[ThreadExecutor]:
    executor = ThreadExecutor(workers=2, max_pending=4, deadline=5.0)
    await executor.start()
    yield executor
    await executor.close(timeout=5)


async def test_factory_builds_each_kind() -> None:
    for kind in EXECUTOR_KINDS:
        executor = make_executor(kind, workers=1, max_pending=2, deadline=1.0)
        assert executor.kind == kind
    with pytest.raises(ValueError, match="unknown executor kind"):
        make_executor("fork", workers=1, max_pending=1, deadline=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending"):
        make_executor("thread", workers=1, max_pending=0, deadline=1.0)
    with pytest.raises(ValueError, match="deadline"):
        make_executor("thread", workers=1, max_pending=1, deadline=float("nan"))


async def test_inline_runs_on_the_loop_thread_and_counts() -> None:
    waits: list[float] = []
    executor = InlineExecutor(max_pending=8, deadline=1.0, on_queue_wait=waits.append)
    with pytest.raises(RuntimeError, match="not started"):
        await executor.run(add, 1, 2)
    await executor.start()
    assert await executor.run(add, 1, 2, scale=10) == 30
    assert await run_in_pool(executor, thread_name) == threading.current_thread().name
    with pytest.raises(DecryptionFailed):
        await executor.run_with_deadline(0.5, fail_decrypt)
    stats = executor.stats()
    assert (stats.kind, stats.completed_total, stats.in_flight, stats.workers_alive) == (
        "inline",
        3,
        0,
        1,
    )
    assert waits == [0.0, 0.0, 0.0]
    await executor.close()
    with pytest.raises(Overloaded):
        await executor.run(add, 1, 2)
    assert executor.stats().rejected_total == 1


async def test_thread_round_trip_on_pool_threads(pool: ThreadExecutor) -> None:
    assert await pool.run(add, 2, 3, scale=2) == 10
    assert (await pool.run(thread_name)).startswith("cryptd-pool-")
    with pytest.raises(DecryptionFailed, match=r"^decryption failed$"):
        await pool.run(fail_decrypt)
    assert pool.stats().completed_total == 3


async def test_thread_backpressure_refuses_at_once(pool: ThreadExecutor) -> None:
    gate = Gate()
    held = [asyncio.ensure_future(pool.run(gate.hold, i)) for i in range(4)]  # 2 run, 2 queue
    await gate.wait_entered(2)
    stats = pool.stats()
    assert (stats.in_flight, stats.queued) == (2, 2)
    refused = pool.run(add, 1, 1)
    with pytest.raises(Overloaded) as info:
        refused.send(None)  # raises on its first step: no await, no waiting
    assert info.value.retry_after >= 1
    assert pool.stats().rejected_total == 1
    gate.release.set()
    assert await asyncio.gather(*held) == [0, 1, 2, 3]
    assert await pool.run(add, 1, 1) == 2


async def test_thread_deadline_drops_unstarted_and_abandons_started() -> None:
    executor = ThreadExecutor(workers=1, max_pending=4, deadline=5.0)
    await executor.start()
    gate = Gate()
    try:
        started = asyncio.ensure_future(executor.run_with_deadline(0.2, gate.hold, 1))
        queued = asyncio.ensure_future(executor.run_with_deadline(0.2, gate.hold, 2))
        with pytest.raises(Overloaded, match=r"deadline exceeded$"):
            await started
        with pytest.raises(Overloaded, match="before the task started"):
            await queued
        stats = executor.stats()
        assert (stats.queued, stats.in_flight, stats.expired_total) == (0, 1, 2)
        gate.release.set()
        assert await executor.run(add, 1, 2) == 3  # the late result went nowhere
        assert gate.ran == [1]  # the dropped task never ran
    finally:
        gate.release.set()
        await executor.close(timeout=5)


async def test_cancelled_caller_frees_its_queue_slot(pool: ThreadExecutor) -> None:
    gate = Gate()
    held = [asyncio.ensure_future(pool.run(gate.hold, i)) for i in range(2)]
    await gate.wait_entered(2)
    waiting = asyncio.ensure_future(pool.run(gate.hold, 99))
    await asyncio.sleep(0)
    assert pool.stats().queued == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.stats().queued == 0
    gate.release.set()
    await asyncio.gather(*held)
    assert 99 not in gate.ran


async def test_thread_close_drains_then_refuses() -> None:
    executor = ThreadExecutor(workers=2, max_pending=8, deadline=5.0)
    await executor.start()
    gate = Gate()
    tasks = [asyncio.ensure_future(executor.run(gate.hold, i)) for i in range(3)]
    await gate.wait_entered(2)
    closing = asyncio.ensure_future(executor.close(timeout=10))
    await asyncio.sleep(0.05)
    assert not closing.done()
    with pytest.raises(Overloaded, match="shutting down"):
        await executor.run(add, 1, 1)
    gate.release.set()
    assert await asyncio.gather(*tasks) == [0, 1, 2]
    await closing
    assert executor.stats().workers_alive == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("cryptd-pool-")]


async def test_thread_close_timeout_fails_waiting_callers() -> None:
    executor = ThreadExecutor(workers=1, max_pending=8, deadline=5.0)
    await executor.start()
    gate = Gate()
    running = asyncio.ensure_future(executor.run(gate.hold, 1))
    await gate.wait_entered(1)
    await executor.close(timeout=0.05)
    with pytest.raises(Overloaded, match="shutting down"):
        await running
    gate.release.set()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("cryptd-pool-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "abandoned pool thread did not exit"
        await asyncio.sleep(0.01)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def init(self, tag: str) -> None:
        self.calls.append(f"init:{tag}:{thread_name()}")

    def reload(self) -> None:
        self.calls.append(f"reload:{thread_name()}")


async def test_thread_initializer_and_broadcast_run_once_on_a_pool_thread() -> None:
    rec = Recorder()
    waits: list[float] = []
    executor = ThreadExecutor(
        workers=3,
        max_pending=4,
        deadline=5.0,
        initializer=rec.init,
        initargs=("k",),
        on_queue_wait=waits.append,
    )
    await executor.start()
    try:
        await executor.broadcast(rec.reload)
        await executor.run(add, 1, 1)
    finally:
        await executor.close()
    assert len(rec.calls) == 2
    assert rec.calls[0].startswith("init:k:cryptd-pool-")
    assert rec.calls[1].startswith("reload:cryptd-pool-")
    assert len(waits) == 1
    assert waits[0] >= 0


def broken_init(secret: str) -> None:
    raise ValueError(f"cannot unwrap keyring with {secret}")


async def test_initializer_failure_is_reported_without_its_text() -> None:
    for kind in ("inline", "thread"):
        executor = make_executor(
            kind,
            workers=2,
            max_pending=1,
            deadline=1.0,
            initializer=broken_init,
            initargs=("hunter2",),
        )
        with pytest.raises(WorkerStartError) as info:
            await executor.start()
        assert "ValueError" in str(info.value)
        assert "hunter2" not in str(info.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("cryptd-pool-")]


async def test_observer_errors_do_not_break_the_pool() -> None:
    def bad_observer(_: float) -> None:
        raise RuntimeError("metrics down")

    executor = ThreadExecutor(workers=1, max_pending=1, deadline=1.0, on_queue_wait=bad_observer)
    await executor.start()
    try:
        assert await executor.run(add, 2, 2) == 4
    finally:
        await executor.close()
