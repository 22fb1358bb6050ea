"""The sliced executor: costly calls on the event loop, a bounded slice of each iteration.

Real loops, real CPU work; the iteration a call runs in is read from a callback that re-arms
itself once per loop iteration (a call_soon made in an iteration runs in the next one)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.errors import DecryptionFailed, Overloaded
from service.pool import SlicedExecutor, WorkerStartError, make_executor


def spin(seconds: float, tag: int) -> int:
    """CPU work on the calling thread, as a private-key operation is."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return tag


class Iterations:
    """Counts event-loop iterations while it runs."""

    def __init__(self) -> None:
        self.current = 0
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.current += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False


async def started(budget: float = 0.0025, max_pending: int = 2048) -> SlicedExecutor:
    executor = SlicedExecutor(budget=budget, max_pending=max_pending)
    await executor.start()
    return executor


async def test_results_exceptions_and_order_pass_through() -> None:
    executor = await started()
    assert executor.kind == "sliced"
    assert await asyncio.gather(*(executor.run(spin, 0.001, i) for i in range(12))) == list(
        range(12)
    )

    def fail() -> None:
        raise DecryptionFailed()

    with pytest.raises(DecryptionFailed):
        await executor.run(fail)
    assert executor.stats().completed_total == 13
    assert threading.current_thread() is threading.main_thread()  # on the loop's thread
    await executor.close()


async def test_each_iteration_runs_at_most_its_budget_of_calls() -> None:
    executor = await started(budget=0.0025)
    iterations = Iterations()
    ran: list[tuple[int, int]] = []

    def timed(tag: int) -> int:
        ran.append((iterations.current, tag))
        return spin(0.001, tag)

    await asyncio.gather(*(executor.run(timed, i) for i in range(20)))
    iterations.stop()
    per_iteration: dict[int, int] = {}
    for iteration, _ in ran:
        per_iteration[iteration] = per_iteration.get(iteration, 0) + 1
    # 2.5 ms of 1 ms calls: two per iteration, never three; and in arrival order.
    assert max(per_iteration.values()) <= 2
    assert len(per_iteration) >= 10
    assert [tag for _, tag in ran] == list(range(20))


async def test_cheap_work_is_served_between_slices() -> None:
    """A stream of costly calls does not hold the loop: a cheap task that only yields gets a
    turn between every two slices, where inline work would run all 30 ms first."""
    executor = await started(budget=0.002)
    turns: list[int] = []
    done = False

    async def cheap() -> None:
        while not done:
            turns.append(executor.stats().completed_total)
            await asyncio.sleep(0)

    task = asyncio.create_task(cheap())
    await asyncio.sleep(0)
    await asyncio.gather(*(executor.run(spin, 0.001, i) for i in range(30)))
    done = True
    await task
    # The cheap task saw the completed count at (nearly) every step from 0 to 30.
    seen = sorted(set(turns))
    assert len(seen) >= 14, seen


async def test_backpressure_refuses_at_once() -> None:
    executor = await started(budget=0.001, max_pending=3)
    calls = [asyncio.ensure_future(executor.run(spin, 0.002, i)) for i in range(5)]
    await asyncio.sleep(0)  # the first ran at once (spending the slice), three queue
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, Overloaded)]
    assert len(refused) == 1
    assert refused[0].retry_after >= 1
    assert results[4] is refused[0]
    assert results[:4] == [0, 1, 2, 3]
    assert executor.stats().rejected_total == 1


async def test_a_call_still_waiting_at_its_deadline_is_dropped_unrun() -> None:
    executor = await started(budget=0.001)
    ran: list[int] = []

    def note(tag: int) -> int:
        ran.append(tag)
        return spin(0.02, tag)

    first = asyncio.ensure_future(executor.run(note, 1))
    second = asyncio.ensure_future(executor.run(note, 2))
    late = asyncio.ensure_future(executor.run_with_deadline(0.005, note, 3))
    with pytest.raises(Overloaded, match="deadline exceeded before the task started"):
        await late
    assert await first == 1
    assert await second == 2
    assert 3 not in ran
    assert executor.stats().expired_total == 1
    with pytest.raises(ValueError, match="deadline"):
        await executor.run_with_deadline(0, note, 4)


async def test_a_cancelled_waiter_never_runs_and_blocks_nobody() -> None:
    executor = await started(budget=0.001)
    ran: list[int] = []

    def note(tag: int) -> int:
        ran.append(tag)
        return spin(0.002, tag)

    calls = [asyncio.ensure_future(executor.run(note, i)) for i in range(4)]
    await asyncio.sleep(0)
    calls[1].cancel()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    assert results[0] == 0
    assert results[2:] == [2, 3]
    assert ran == [0, 2, 3]
    assert executor.stats().queued == 0
    assert await executor.run(note, 9) == 9  # the slice is not stuck


async def test_close_lets_the_waiting_finish_then_refuses() -> None:
    executor = await started(budget=0.001)
    calls = [asyncio.ensure_future(executor.run(spin, 0.002, i)) for i in range(5)]
    await asyncio.sleep(0)
    await executor.close(timeout=5)
    assert [await call for call in calls] == list(range(5))
    with pytest.raises(Overloaded, match="shutting down"):
        await executor.run(spin, 0, 0)
    assert executor.stats().workers_alive == 0


async def test_factory_initializer_and_queue_wait_observer() -> None:
    waits: list[float] = []
    executor = make_executor(
        "sliced",
        workers=4,
        max_pending=8,
        deadline=1.0,
        on_queue_wait=waits.append,
        slice_budget=0.001,
    )
    with pytest.raises(RuntimeError, match="not started"):
        await executor.run(spin, 0, 0)
    await executor.start()
    await asyncio.gather(*(executor.run(spin, 0.002, i) for i in range(3)))
    assert len(waits) == 3
    assert waits[0] == 0.0
    assert max(waits) > 0

    def broken(secret: str) -> None:
        raise ValueError(secret)

    failing = make_executor(
        "sliced", workers=1, max_pending=1, deadline=1.0, initializer=broken, initargs=("hunter2",)
    )
    with pytest.raises(WorkerStartError) as info:
        await failing.start()
    assert "ValueError" in str(info.value)
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError, match="deadline"):
        make_executor("sliced", workers=1, max_pending=1, deadline=1.0, slice_budget=0)
