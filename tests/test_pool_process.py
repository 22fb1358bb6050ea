"""Process executor with real worker processes: results, errors, backpressure, deadlines, crashes
(SIGKILL), broadcast, draining, initializer, signals and the death of the parent.

Task functions live at module level: workers import this module to unpickle them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from service.errors import DecryptionFailed, Internal, KeyNotFound, Overloaded
from service.pool import ProcessExecutor, WorkerStartError

pytestmark = pytest.mark.slow  # worker processes started, killed and replaced

ROOT = Path(__file__).resolve().parent.parent

# -- task functions (run in the workers) ------------------------------------------------------


def record_start(directory: str) -> None:
    """Initializer: leaves one file per worker process start."""
    Path(directory, f"init-{os.getpid()}").touch()


def record_broadcast(directory: str) -> None:
    Path(directory, f"broadcast-{os.getpid()}").touch()


def add(a: int, b: int, *, scale: int = 1) -> int:
    return (a + b) * scale


def echo_batch(items: list[bytes]) -> list[bytes]:
    return [item[::-1] for item in items]


def pid() -> int:
    return os.getpid()


def sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def sleep_then_mark(seconds: float, marker: str) -> int:
    time.sleep(seconds)
    Path(marker).touch()
    return os.getpid()


def raise_domain_error(kind: str) -> None:
    if kind == "decrypt":
        raise DecryptionFailed()
    raise KeyNotFound("key 'payments' version 9 not found")


class TwoArgError(Exception):
    def __init__(self, secret: str, detail: str) -> None:
        super().__init__(f"{secret}: {detail}")


def raise_unpicklable(secret: str) -> None:
    raise TwoArgError(secret, "cannot be rebuilt by unpickling")


def unpicklable_result() -> object:
    return lambda: None


def hold_first_attempt(directory: str) -> int:
    """The first call parks (its worker gets killed by the test); a retry returns at once."""
    attempts = Path(directory)
    first = not any(attempts.iterdir())
    Path(directory, f"attempt-{os.getpid()}").touch()
    if first:
        time.sleep(10)
    return os.getpid()


def kill_own_worker() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def exit_worker() -> None:
    sys.exit(3)


# -- helpers -------------------------------------------------------------------------------------


def pids_with(directory: Path, prefix: str) -> set[int]:
    return {int(p.name.split("-", 1)[1]) for p in directory.iterdir() if p.name.startswith(prefix)}


def is_gone(process_id: int) -> bool:
    """Exited: no such process, or a zombie left to a container's init that does not reap."""
    try:
        state = Path(f"/proc/{process_id}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


async def eventually(predicate: Callable[[], bool], what: str, within: float = 10.0) -> None:
    limit = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < limit, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest_asyncio.fixture(loop_scope="function")
async def pool(tmp_path: Path) -> AsyncIterator[ProcessExecutor]:
    executor = ProcessExecutor(
        workers=2,
        max_pending=4,
        deadline=10.0,
        initializer=record_start,
        initargs=(str(tmp_path),),
    )
    await executor.start()
    yield executor
    await executor.close(timeout=10)
    assert not multiprocessing.active_children()


# -- tests -----------------------------------------------------------------------------------------


async def test_results_round_trip(pool: ProcessExecutor, tmp_path: Path) -> None:
    assert await pool.run(add, 2, 3, scale=4) == 20
    assert await pool.run_with_deadline(5.0, add, 1, 1) == 2
    worker_pid = await pool.run(pid)
    assert worker_pid != os.getpid()
    assert worker_pid in pids_with(tmp_path, "init-")
    stats = pool.stats()
    assert (stats.kind, stats.workers, stats.workers_alive, stats.completed_total) == (
        "process",
        2,
        2,
        3,
    )


async def test_batch_of_one_hundred_items_in_one_task(pool: ProcessExecutor) -> None:
    items = [os.urandom(1024) for _ in range(100)]
    assert await pool.run(echo_batch, items) == [item[::-1] for item in items]
    large = [os.urandom(1024) for _ in range(1000)]  # larger than the receive buffer
    assert await pool.run(echo_batch, large) == [item[::-1] for item in large]


async def test_exceptions_keep_type_and_message(pool: ProcessExecutor) -> None:
    with pytest.raises(DecryptionFailed, match=r"^decryption failed$"):
        await pool.run(raise_domain_error, "decrypt")
    with pytest.raises(KeyNotFound, match=r"^key 'payments' version 9 not found$"):
        await pool.run(raise_domain_error, "key")
    with pytest.raises(Internal) as info:
        await pool.run(raise_unpicklable, "hunter2")
    assert "hunter2" not in str(info.value)
    with pytest.raises(Internal, match="cannot be sent back"):
        await pool.run(unpicklable_result)
    assert await pool.run(add, 1, 1) == 2
    assert pool.stats().crashes_total == 0


async def test_unpicklable_arguments_fail_in_the_caller(pool: ProcessExecutor) -> None:
    with pytest.raises(TypeError, match="pickle"):
        await pool.run(add, 1, threading.Lock())  # type: ignore[arg-type]
    stats = pool.stats()
    assert (stats.queued, stats.in_flight) == (0, 0)


async def test_backpressure_refuses_at_once_when_full(pool: ProcessExecutor) -> None:
    busy = [asyncio.ensure_future(pool.run(sleep_then_pid, 0.3)) for _ in range(4)]
    await asyncio.sleep(0)
    assert pool.stats().queued + pool.stats().in_flight == 4
    refused = pool.run(add, 1, 1)
    with pytest.raises(Overloaded) as info:
        refused.send(None)  # raises on its first step: never suspends, never waits
    assert info.value.retry_after >= 1
    assert pool.stats().rejected_total == 1
    assert len(set(await asyncio.gather(*busy))) == 2  # both workers took work
    assert await pool.run(add, 1, 1) == 2


async def test_deadline_drops_unstarted_and_discards_late_results(tmp_path: Path) -> None:
    executor = ProcessExecutor(workers=1, max_pending=4, deadline=10.0)
    await executor.start()
    try:
        first, second = tmp_path / "first", tmp_path / "second"
        started = asyncio.ensure_future(
            executor.run_with_deadline(0.3, sleep_then_mark, 1.0, str(first))
        )
        queued = asyncio.ensure_future(
            executor.run_with_deadline(0.3, sleep_then_mark, 0.0, str(second))
        )
        with pytest.raises(Overloaded, match=r"deadline exceeded$"):
            await started
        with pytest.raises(Overloaded, match="before the task started"):
            await queued
        stats = executor.stats()
        assert (stats.queued, stats.in_flight, stats.expired_total) == (0, 1, 2)
        assert await executor.run(add, 20, 22) == 42  # waits behind the abandoned task
        assert first.exists()  # the started task ran to completion
        assert not second.exists()  # the dropped one never ran
    finally:
        await executor.close()


async def test_sigkill_while_holding_a_task_retries_it_elsewhere(
    pool: ProcessExecutor, tmp_path: Path
) -> None:
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    task = asyncio.ensure_future(pool.run(hold_first_attempt, str(attempts)))
    await eventually(lambda: any(attempts.iterdir()), "the task to start")
    (victim,) = pids_with(attempts, "attempt-")
    os.kill(victim, signal.SIGKILL)
    survivor = await task
    assert survivor != victim
    assert len(pids_with(attempts, "attempt-")) == 2  # ran exactly twice
    await eventually(lambda: pool.stats().workers_alive == 2, "the replacement worker")
    assert pool.stats().crashes_total == 1
    assert len(pids_with(tmp_path, "init-")) == 3  # the replacement ran the initializer
    assert is_gone(victim)
    assert len(set(await asyncio.gather(*(pool.run(sleep_then_pid, 0.2) for _ in range(2))))) == 2


async def test_a_task_that_kills_its_worker_twice_fails_internal(pool: ProcessExecutor) -> None:
    with pytest.raises(Internal, match="worker process died"):
        await pool.run(kill_own_worker)
    assert pool.stats().crashes_total == 2
    assert await pool.run(add, 2, 2) == 4
    await eventually(lambda: pool.stats().workers_alive == 2, "both replacements")


async def test_sys_exit_in_a_task_is_an_error_not_a_crash(pool: ProcessExecutor) -> None:
    with pytest.raises(Internal):
        await pool.run(exit_worker)
    assert pool.stats().crashes_total == 0
    assert await pool.run(add, 1, 2) == 3


async def test_broadcast_reaches_every_worker(pool: ProcessExecutor, tmp_path: Path) -> None:
    await pool.broadcast(functools.partial(record_broadcast, str(tmp_path)))
    assert pids_with(tmp_path, "broadcast-") == pids_with(tmp_path, "init-")
    assert len(pids_with(tmp_path, "broadcast-")) == 2
    with pytest.raises(DecryptionFailed):
        await pool.broadcast(functools.partial(raise_domain_error, "decrypt"))


async def test_stop_signals_do_not_kill_workers() -> None:
    executor = ProcessExecutor(workers=1, max_pending=2, deadline=10.0)
    await executor.start()
    try:
        worker = await executor.run(pid)
        os.kill(worker, signal.SIGTERM)
        os.kill(worker, signal.SIGINT)
        assert await executor.run(sleep_then_pid, 0.2) == worker
        assert executor.stats().crashes_total == 0
    finally:
        await executor.close()
    assert is_gone(worker)


async def test_close_drains_in_flight_and_queued_work(tmp_path: Path) -> None:
    executor = ProcessExecutor(
        workers=2, max_pending=8, deadline=10.0, initializer=record_start, initargs=(str(tmp_path),)
    )
    await executor.start()
    tasks = [asyncio.ensure_future(executor.run(sleep_then_pid, 0.3)) for _ in range(3)]
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(executor.close(timeout=10))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="shutting down"):
        await executor.run(add, 1, 1)
    results = await asyncio.gather(*tasks)
    await closing
    assert set(results) == pids_with(tmp_path, "init-")
    assert executor.stats().completed_total == 3
    assert executor.stats().workers_alive == 0
    assert not multiprocessing.active_children()
    assert all(is_gone(p) for p in results)


async def test_close_timeout_fails_callers_and_kills_busy_workers() -> None:
    executor = ProcessExecutor(workers=1, max_pending=2, deadline=30.0)
    await executor.start()
    stuck = asyncio.ensure_future(executor.run(sleep_then_pid, 20.0))
    await asyncio.sleep(0.1)
    await executor.close(timeout=0.2)
    with pytest.raises(Overloaded, match="shutting down"):
        await stuck
    assert not multiprocessing.active_children()


def failing_initializer(secret: str) -> None:
    raise ValueError(f"wrong master key {secret}")


async def test_initializer_failure_stops_start_without_leaking_its_text() -> None:
    executor = ProcessExecutor(
        workers=2,
        max_pending=2,
        deadline=1.0,
        initializer=failing_initializer,
        initargs=("hunter2",),
    )
    with pytest.raises(WorkerStartError) as info:
        await executor.start()
    assert "ValueError" in str(info.value)
    assert "hunter2" not in str(info.value)
    assert not multiprocessing.active_children()


PARENT_SCRIPT = """
import asyncio, json, os, sys, time
from service.pool import ProcessExecutor

def slow_pid():
    time.sleep(0.3)
    return os.getpid()

async def main():
    executor = ProcessExecutor(workers=2, max_pending=4, deadline=10.0)
    await executor.start()
    pids = await asyncio.gather(executor.run(slow_pid), executor.run(slow_pid))
    print(json.dumps(pids), flush=True)
    await asyncio.sleep(60)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_workers_exit_when_the_parent_dies(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=env, cwd=tmp_path
    ) as parent:
        assert parent.stdout is not None
        workers = json.loads(parent.stdout.readline())
        assert len(set(workers)) == 2
        parent.kill()
    limit = time.monotonic() + 10
    while not all(is_gone(p) for p in workers):
        assert time.monotonic() < limit, "orphaned workers did not exit"
        time.sleep(0.02)


def test_process_pool_on_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        executor = ProcessExecutor(
            workers=2,
            max_pending=8,
            deadline=10.0,
            initializer=record_start,
            initargs=(str(tmp_path),),
        )
        await executor.start()
        try:
            assert await asyncio.gather(*(executor.run(add, i, i) for i in range(8))) == [
                2 * i for i in range(8)
            ]
            with pytest.raises(DecryptionFailed):
                await executor.run(raise_domain_error, "decrypt")
            victim = await executor.run(pid)
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: executor.stats().crashes_total == 1, "crash detection")
            await eventually(lambda: executor.stats().workers_alive == 2, "replacement")
            assert await executor.run(add, 1, 2) == 3
        finally:
            await executor.close()

    uvloop.run(scenario())
    assert len(pids_with(tmp_path, "init-")) == 3
    assert not multiprocessing.active_children()


async def test_forkserver_start_method_serves_and_replaces(tmp_path: Path) -> None:
    executor = ProcessExecutor(
        workers=1,
        max_pending=2,
        deadline=10.0,
        initializer=record_start,
        initargs=(str(tmp_path),),
        start_method="forkserver",
    )
    await executor.start()
    try:
        victim = await executor.run(pid)
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: executor.stats().crashes_total == 1, "crash detection")
        assert await executor.run(add, 3, 4) == 7
        assert await executor.run(pid) != victim
    finally:
        await executor.close()
    assert len(pids_with(tmp_path, "init-")) == 2
    with pytest.raises(ValueError, match="fork is unsafe"):
        ProcessExecutor(workers=1, max_pending=1, deadline=1.0, start_method="fork")
