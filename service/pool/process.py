"""Process executor: a small pool of worker processes that survives the death of any of them.

Not concurrent.futures.ProcessPoolExecutor: one dead worker breaks that whole pool
(BrokenProcessPool). Here every worker is a "spawn" process (safe beside threads and uvloop)
with its own Unix socket. The loop hands a job to an idle worker, reads results as they arrive
(no reader threads) and watches each process's sentinel: a worker that dies is replaced (its
initializer runs again) and the job it held runs once more on another worker.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import logging
import multiprocessing
import signal
import socket
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from typing import Any

from service.errors import Internal
from service.pool.base import ExecutorKind, QueueWaitObserver, WorkerStartError
from service.pool.channel import FrameProtocol
from service.pool.queued import Job, Lifecycle, QueuedExecutor
from service.pool.wire import Kind, dumps, loads
from service.pool.worker import STOP_SIGNALS, worker_main

log = logging.getLogger("cryptd.pool")

START_METHODS = ("spawn", "forkserver")
_RESPAWN_DELAY_MIN = 0.1
_RESPAWN_DELAY_MAX = 10.0
_REAP_TIMEOUT = 5.0  # only reaps: the sentinel already said the process has exited


class _State(enum.Enum):
    STARTING = enum.auto()
    READY = enum.auto()
    STOPPING = enum.auto()
    DEAD = enum.auto()


@dataclass(eq=False)
class _Worker:
    slot: int
    process: SpawnProcess
    channel: FrameProtocol
    ready: asyncio.Future[None]
    exited: asyncio.Future[None]
    state: _State = _State.STARTING
    job: Job[bytes] | None = None
    broadcasts: dict[int, asyncio.Future[BaseException | None]] = field(default_factory=dict)
    init_error: str | None = None


class ProcessExecutor(QueuedExecutor[bytes]):
    """``initializer(*initargs)`` runs once in every worker process, and again in each
    replacement; it is pickled to the child over a pipe (never argv or the environment).
    Functions, arguments and results cross by pickle: module-level functions and plain data."""

    def __init__(
        self,
        *,
        workers: int,
        max_pending: int,
        deadline: float,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        on_queue_wait: QueueWaitObserver | None = None,
        start_method: str = "spawn",
        start_timeout: float = 60.0,
        stop_timeout: float = 5.0,
        name: str = "cryptd-pool",
    ) -> None:
        super().__init__(
            workers=workers, max_pending=max_pending, deadline=deadline, on_queue_wait=on_queue_wait
        )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS} (fork is unsafe here)")
        self._context = multiprocessing.get_context(start_method)
        self._initializer = initializer
        self._initargs = initargs
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._name = name
        self._slots: dict[int, _Worker] = {}
        self._idle: list[_Worker] = []
        self._spawn_failures: dict[int, int] = {}
        self._respawns: dict[int, asyncio.TimerHandle] = {}
        self._crashes = 0
        _live_executors.add(self)

    @property
    def kind(self) -> ExecutorKind:
        return "process"

    async def broadcast(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` in every worker process, after the task it is running if any."""
        if self._lifecycle is not Lifecycle.RUNNING:
            if self._lifecycle in (Lifecycle.NEW, Lifecycle.STARTING):
                raise RuntimeError("executor not started")
            return  # closing: nothing left to update
        loop = self._running_loop()
        payload = dumps(fn)
        waits = []
        for worker in self._slots.values():
            if worker.state in (_State.STARTING, _State.READY):
                msg_id = next(self._ids)
                done: asyncio.Future[BaseException | None] = loop.create_future()
                worker.broadcasts[msg_id] = done
                worker.channel.send(Kind.BROADCAST, msg_id, payload)
                waits.append(done)
        for error in await asyncio.gather(*waits):
            if error is not None:
                raise error

    # -- QueuedExecutor hooks -----------------------------------------------------------------

    def _encode(
        self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> bytes:
        return dumps((fn, args, kwargs))

    def _has_idle_worker(self) -> bool:
        return bool(self._idle)

    def _start_job(self, job: Job[bytes]) -> None:
        assert job.payload is not None
        worker = self._idle.pop()
        worker.job = job
        worker.channel.send(Kind.TASK, job.id, job.payload)

    def _workers_alive(self) -> int:
        return sum(1 for w in self._slots.values() if w.state is _State.READY)

    def _crashes_total(self) -> int:
        return self._crashes

    async def _start_workers(self) -> None:
        workers = [self._spawn(slot) for slot in range(self._workers)]
        readies = [w.ready for w in workers]
        try:
            async with asyncio.timeout(self._start_timeout):
                await asyncio.gather(*readies)
        except BaseException as exc:
            for ready in readies:  # mark every outcome as seen; the first one is raised
                if ready.done() and not ready.cancelled():
                    ready.exception()
            await self._stop_workers(drained=True)
            if isinstance(exc, TimeoutError):
                raise WorkerStartError("pool workers did not start in time") from None
            raise

    async def _stop_workers(self, *, drained: bool) -> None:
        for handle in self._respawns.values():
            handle.cancel()
        self._respawns.clear()
        workers = list(self._slots.values())
        for worker in workers:
            if worker.state is not _State.DEAD:
                worker.state = _State.STOPPING
            worker.channel.close()  # the worker reads end of stream and exits
            if not drained and worker.job is not None:
                worker.process.kill()  # busy with work nobody waits for any more
        self._idle.clear()
        exits = [w.exited for w in workers]
        if not exits:
            return
        _, late = await asyncio.wait(exits, timeout=self._stop_timeout)
        for worker in workers:
            if not worker.exited.done():
                # Busy past the timeout in code we cannot interrupt (and deaf to SIGTERM).
                log.warning("pool worker %d did not stop; killing it", worker.slot)
                worker.process.kill()
        if late:
            await asyncio.wait(late)

    # -- worker lifecycle -----------------------------------------------------------------------

    def _spawn(self, slot: int) -> _Worker:
        loop = self._running_loop()
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = self._context.Process(  # type: ignore[attr-defined]
                target=worker_main,
                args=(child_sock, self._initializer, self._initargs),
                name=f"{self._name}-{slot}",
                daemon=True,
            )
            with _stop_signals_blocked():
                process.start()
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        channel = FrameProtocol(
            lambda kind, msg_id, payload: self._on_frame(worker, kind, msg_id, payload),
            lambda: self._on_channel_lost(worker),
        )
        worker = _Worker(
            slot=slot,
            process=process,
            channel=channel,
            ready=loop.create_future(),
            exited=loop.create_future(),
        )
        self._slots[slot] = worker
        loop.add_reader(process.sentinel, self._on_exit, worker)
        connect = loop.create_unix_connection(lambda: worker.channel, sock=parent_sock)
        task = loop.create_task(connect)
        task.add_done_callback(lambda t: self._on_connected(worker, parent_sock, t))
        return worker

    def _on_connected(self, worker: _Worker, sock: socket.socket, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            log.warning("pool worker %d: channel setup failed; replacing it", worker.slot)
            sock.close()
            if worker.state is not _State.DEAD:
                worker.process.kill()

    def _on_channel_lost(self, worker: _Worker) -> None:
        # A worker that cannot talk to us is of no use; its exit is handled by _on_exit.
        if worker.state in (_State.STARTING, _State.READY):
            worker.process.kill()

    def _on_exit(self, worker: _Worker) -> None:
        """The process's sentinel became readable: it has exited."""
        loop = self._running_loop()
        process = worker.process
        loop.remove_reader(process.sentinel)
        process.join(_REAP_TIMEOUT)
        exitcode = process.exitcode
        process.close()
        worker.channel.abort()
        previous, worker.state = worker.state, _State.DEAD
        if worker in self._idle:
            self._idle.remove(worker)
        if self._slots.get(worker.slot) is worker:
            del self._slots[worker.slot]
        for done in worker.broadcasts.values():
            if not done.done():
                done.set_result(None)  # the replacement's initializer loads current state
        worker.broadcasts.clear()
        worker.exited.set_result(None)
        if previous is _State.STOPPING:
            return
        self._crashes += 1
        if previous is _State.STARTING:
            reason = worker.init_error or f"exit code {exitcode}"
            log.warning("pool worker %d failed to start (%s)", worker.slot, reason)
            if self._lifecycle is Lifecycle.STARTING:
                worker.ready.set_exception(
                    WorkerStartError(f"pool worker failed to start ({reason})")
                )
            else:
                worker.ready.cancel()
            failures = self._spawn_failures.get(worker.slot, 0) + 1
            self._spawn_failures[worker.slot] = failures
        else:
            log.warning("pool worker %d died (exit code %s); replacing it", worker.slot, exitcode)
            failures = 0
        if worker.job is not None:
            job, worker.job = worker.job, None
            self._lost(job)
        if self._lifecycle is Lifecycle.RUNNING or (
            self._lifecycle is Lifecycle.CLOSING and self._pending
        ):
            self._respawn_later(worker.slot, failures)
        self._pump()
        self._settle()

    def _respawn_later(self, slot: int, failures: int) -> None:
        if failures == 0:
            self._respawn(slot)
            return
        delay = min(_RESPAWN_DELAY_MAX, _RESPAWN_DELAY_MIN * 2 ** (failures - 1))
        self._respawns[slot] = self._running_loop().call_later(delay, self._respawn, slot)

    def _respawn(self, slot: int) -> None:
        self._respawns.pop(slot, None)
        if self._lifecycle not in (Lifecycle.RUNNING, Lifecycle.CLOSING):
            return
        try:
            self._spawn(slot)
        except OSError as exc:  # out of processes or descriptors: try again later
            log.warning("pool worker %d could not be started (%s)", slot, type(exc).__name__)
            failures = self._spawn_failures.get(slot, 0) + 1
            self._spawn_failures[slot] = failures
            self._respawn_later(slot, failures)

    # -- frames from a worker -----------------------------------------------------------------

    def _on_frame(self, worker: _Worker, kind: Kind, msg_id: int, payload: memoryview) -> None:
        if kind is Kind.RESULT or kind is Kind.ERROR:
            job = worker.job
            if job is None or job.id != msg_id:
                worker.channel.abort()  # out of step: kill it rather than guess
                return
            worker.job = None
            if kind is Kind.ERROR:
                self._finish(job, decode_error(payload))
            else:
                # Decoded from the receive buffer, and only if the caller still waits.
                self._finish(job, lambda: decode_result(payload))
            if worker.state is _State.READY:
                self._idle.append(worker)
            self._pump()
        elif kind is Kind.READY:
            worker.state = _State.READY
            self._spawn_failures.pop(worker.slot, None)
            if not worker.ready.done():
                worker.ready.set_result(None)
            self._idle.append(worker)
            self._pump()
        elif kind is Kind.BROADCAST_DONE or kind is Kind.BROADCAST_FAILED:
            done = worker.broadcasts.pop(msg_id, None)
            if done is not None and not done.done():
                error = decode_error(payload) if kind is Kind.BROADCAST_FAILED else None
                done.set_result(error)
        elif kind is Kind.INIT_FAILED:
            try:
                name = decode_result(payload)
            except Internal:
                name = None
            worker.init_error = name if isinstance(name, str) else "unknown error"
        else:
            worker.channel.abort()


def decode_result(data: bytes | memoryview) -> object:
    try:
        return loads(data)
    except Exception:
        raise Internal("task result cannot be decoded") from None


def decode_error(payload: memoryview) -> BaseException:
    try:
        error = loads(payload)
    except Exception:
        return Internal("task failed with an error that cannot be decoded")
    if not isinstance(error, Exception):
        return Internal("task failed with an error that cannot be decoded")
    return error


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """Start a child with SIGINT/SIGTERM blocked: the mask is inherited, so a signal sent to
    the process group while the child boots waits until the child has chosen to ignore it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# At interpreter exit multiprocessing joins its children; workers deaf to SIGTERM would wait
# for end of stream on sockets we still hold. Runs before multiprocessing's hook (atexit is
# LIFO and multiprocessing registered first).
_live_executors: weakref.WeakSet[ProcessExecutor] = weakref.WeakSet()


@atexit.register
def _kill_leftover_workers() -> None:
    for executor in list(_live_executors):
        for worker in list(executor._slots.values()):
            with contextlib.suppress(Exception):
                worker.process.kill()
