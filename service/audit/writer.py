"""The audit file: records made durable in groups before their requests are answered.

One job, kept in one module (over 400 lines): the group commit, the file it writes and the
recovery of that file (torn tail, rotation, reopening) share state no other module may touch.

A request hands over its record and waits (without blocking the event loop) until a sync that
covers it returned. The event loop itself writes each group of records (one ``write`` to the
page cache, at the end of the loop pass) and asks a small process of its own
(:mod:`service.audit.barrier`) for the ``fdatasync``; while that sync runs, the groups that
follow are written and share the next one (group commit), so throughput holds while each answer
still follows its record to the disk. A process, not a thread: the loop never hands the GIL over
to learn that a sync finished, it sees the answer on a socket with the other connections. When
that process dies it is started again and syncs everything not yet durable; when it cannot be
started the loop syncs by itself. A thread of the writer handles what does not come from the
loop: records of other threads, checkpoints due on time, probes of a failing file, rotation
(each synced on that thread); the file and the chain are shared under a lock.

Failure is never silent: a write or sync that fails rolls the file back to the last durable
line (so the chain stays whole), tells every waiting request (the API then answers 503
``audit_unavailable`` when it fails closed) and counts the records lost. Each batch first checks
that the path still names the open file and that it was not made read-only, so a deleted
directory, a removed or replaced file or a ``chmod a-w`` is seen at once; the writer reopens the
path as soon as it can and the next batch succeeds, with no restart.

Each server worker writes its own stream (``CRYPTD_AUDIT_LOG`` for worker 0, ``…​.w<N>`` for
the others; a file held by another process makes this one write ``…​.p<pid>``). Rotation (on
SIGHUP, or when the file passes ``max_bytes``) ends the file with a checkpoint, renames it to
``<active>.<last seq, 12 digits>`` and continues the chain in a fresh file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import glob
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

import orjson

from service.audit import barrier, chain, checkpoint
from service.audit.chain import Head

log = logging.getLogger("cryptd.audit")

RETRY_INTERVAL = 1.0  # seconds between probes of a file that could not be written
GROUP_DELAY = 0.001  # default: the most a record waits for running requests to join its sync
GROUP_MAX = 512  # records that start a sync without waiting for the others

Format = Callable[[Any], dict[str, Any] | bytes]
"""format(record) -> the line's fields (after seq and prev), run when its group is written (on
the event loop, or the writer's thread): a dict, or those fields already serialized as one JSON
object. A record handed over as bytes is such an object already and is not formatted."""


class SecondarySink(Protocol):
    def send(self, lines: list[bytes]) -> None:
        """Take durable lines; must never block."""


def utc(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def stream_path(base: str, index: int) -> str:
    return base if index == 0 else f"{base}.w{index}"


class _Waiters:
    """The requests of one group, settled with one call per event loop."""

    __slots__ = ("by_loop", "callbacks")

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[bool]]] = {}
        self.callbacks: list[Callable[[bool], None]] = []

    def settle(self, ok: bool) -> None:
        for loop, futures in self.by_loop.items():
            try:
                here = asyncio.get_running_loop() is loop
            except RuntimeError:
                here = False
            if here:  # the loop's own reply handler: no wake-up through its self-pipe
                _resolve(futures, ok)
                continue
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, futures, ok)
        for callback in self.callbacks:
            callback(ok)


def _resolve(futures: list[asyncio.Future[bool]], ok: bool) -> None:
    for future in futures:
        # Only a cancelled future is done already: no done() call for all the others (and
        # try, not contextlib.suppress: 2.6 times as fast per future, timeit).
        try:  # noqa: SIM105
            future.set_result(ok)
        except asyncio.InvalidStateError:
            pass


_new = tuple.__new__

_Pending = tuple[Any, "asyncio.Future[bool] | Callable[[bool], None] | None"]


class _State(NamedTuple):
    """What the file holds after a group: to roll back to when a later sync fails."""

    size: int
    head: Head
    since_checkpoint: int
    open_line_due: bool


class _Group(NamedTuple):
    """Records written to the page cache, answered once a sync that covers them returns."""

    id: int
    waiters: _Waiters
    lines: list[bytes]
    records: int
    state: _State


class AuditWriter:
    def __init__(
        self,
        base: str,
        *,
        index: int = 0,
        format: Format,
        signer: checkpoint.Signer | None,
        checkpoint_every: int = 1000,
        checkpoint_interval: float = 10.0,
        max_bytes: int = 0,
        on_failure: Callable[[int], None] = lambda lost: None,
        secondary: SecondarySink | None = None,
        group_delay: float = GROUP_DELAY,
    ) -> None:
        """``group_delay``: seconds a record may wait for the requests still running on its
        event loop before the group is written (0: at the end of the loop pass)."""
        self.base = base
        self.stream = f"w{index}"
        self.path = stream_path(base, index)
        self._format = format
        self._signer = signer
        self._every = checkpoint_every
        self._interval = checkpoint_interval
        self._max_bytes = max_bytes
        self._on_failure = on_failure
        self._secondary = secondary
        # The file and the chain are touched under this lock: by the event loop (requests'
        # groups) and by the thread (records of other threads, checkpoints, rotation).
        self._mutex = threading.Lock()
        self._pending: collections.deque[_Pending] = collections.deque()  # the loop's
        self._queued: collections.deque[_Pending] = collections.deque()  # other threads'
        self._unsynced: collections.deque[_Group] = collections.deque()
        self._next_group = 1
        # The thread's wake-up: a lock held while none is pending, released to wake it (any
        # thread may release a Lock).
        self._wake = threading.Lock()
        self._wake.acquire()
        self._kick_due = False  # a write is scheduled on the loop
        self._timer: asyncio.TimerHandle | None = None  # the group's deadline
        self._group_delay = group_delay
        self._running = 0  # requests begun on the loop whose records are not yet pending
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that watches the syncs
        self._syncer: barrier.SyncProcess | None = None
        self._in_flight = False  # a sync was asked of the process and not yet answered
        self._held = False  # a group was complete while a sync ran: written on its answer
        self._inline_until = 0.0  # the process keeps dying: syncs on the loop until then
        self.sync_restarts = 0  # sync processes started again after one died
        self.syncs = 0  # syncs that made groups durable (the process's and inline ones)
        self._rotate = False
        self._closing = False
        self._fd = -1
        self._ino: tuple[int, int] | None = None
        self._sync_fd = -1  # the sync process's own open file description of the file
        self._file = 0  # counts the files opened: tells the sync process when to take a new one
        self._size = 0
        self._head = Head()
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._open_line_due = False
        self._durable = _State(0, Head(), 0, False)
        self.error: str | None = None  # why the last write failed; None once one succeeds
        self.failures = 0
        self.signing_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="cryptd-audit", daemon=True)
        # At start: a file that cannot be opened is an error the operator sees now. Its
        # audit.open line is written at once, so no file of the trail is ever left empty.
        with self._mutex:
            self._open()
            if self._append([], _Waiters(), checkpoint_after=False):
                self._sync_inline()
        self._thread.start()

    # -- the request side (the event loop) ----------------------------------------------------

    def begin(self) -> None:
        """A request that will commit a record has started on this event loop."""
        self._running += 1

    def end(self) -> None:
        """A request counted by :meth:`begin` left without a record (its client went away)."""
        self._running -= 1
        if self._pending:
            self._group(asyncio.get_running_loop())

    def commit(self, record: Any, *, begun: bool = False) -> asyncio.Future[bool]:
        """To await on the event loop: True once ``record`` is on disk; False when it could not
        be written. ``begun``: the request was counted by :meth:`begin`. (A future, not a
        coroutine: one object fewer to make and step through per request.)"""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        future: asyncio.Future[bool] = loop.create_future()
        self._pending.append((record, future))
        if begun:
            self._running -= 1
        # _group(), inlined: one call fewer per request.
        if self._running <= 0 or len(self._pending) >= GROUP_MAX or not self._group_delay:
            if not self._kick_due:
                self._kick_due = True
                loop.call_soon(self._kick)
        elif self._timer is None:
            self._timer = loop.call_later(self._group_delay, self._kick)
        return future

    def _group(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write the group once no other request of this loop is about to add its record (or
        the group is full); while some are, wait for them at most ``group_delay``. A sync costs
        the same for one record as for a hundred, so every record that joins saves one (as
        PostgreSQL's ``commit_delay``)."""
        if self._running <= 0 or len(self._pending) >= GROUP_MAX or not self._group_delay:
            if not self._kick_due:
                self._kick_due = True
                loop.call_soon(self._kick)  # after this loop pass's other ready requests
        elif self._timer is None:
            self._timer = loop.call_later(self._group_delay, self._kick)

    def _kick(self) -> None:
        self._kick_due = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._in_flight:  # the sync's answer writes them: they share the next one
            self._held = True
        else:
            self._write_and_sync()

    def _write_and_sync(self) -> None:
        """On the loop: write what is pending (one ``write``, to the page cache) and ask the
        sync process for a barrier over every group not yet durable."""
        with self._mutex:
            if self._pending:
                batch = list(self._pending)
                self._pending.clear()
                self._write_loop_group(batch)
                if self._max_bytes and self._size >= self._max_bytes:
                    self._signal()  # the thread rotates the file
            if self._unsynced and not self._in_flight:
                self._request_sync()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._mutex:
            old, self._loop = self._loop, loop
            # The loop's groups hold only its own futures (_write_loop_group): records still
            # pending from the old loop go to the thread, which tells each future's own loop.
            while self._pending:
                self._queued.append(self._pending.popleft())
            if old is not None:
                self._kick_due = False
                self._timer = None
                self._signal()
            syncer = self._syncer
            if syncer is not None:
                if old is not None and not old.is_closed():
                    with contextlib.suppress(RuntimeError, ValueError):
                        old.remove_reader(syncer.fileno())
                loop.add_reader(syncer.fileno(), self._on_reply)

    def _request_sync(self) -> None:
        """(Under the mutex, on the loop.) One sync for all the groups written so far."""
        upto = self._unsynced[-1].id
        syncer = self._syncer
        if syncer is None and time.monotonic() >= self._inline_until:
            syncer = self._start_syncer()
        if syncer is not None and self._sync_fd >= 0:
            try:
                syncer.request(upto, self._sync_fd, self._file)
            except OSError:
                self._stop_syncer()
            else:
                self._in_flight = True
                return
        self._sync_inline()  # no process: the loop waits for the disk itself, still correct

    def _start_syncer(self) -> barrier.SyncProcess | None:
        loop = self._loop
        if loop is None:
            return None
        try:
            syncer = barrier.SyncProcess()
        except Exception as exc:  # whatever the reason, the loop syncs by itself meanwhile
            log.error("audit sync process not started", extra={"error_type": type(exc).__name__})
            self._inline_until = time.monotonic() + RETRY_INTERVAL
            return None
        loop.add_reader(syncer.fileno(), self._on_reply)
        self._syncer = syncer
        return syncer

    def _stop_syncer(self) -> None:
        syncer, self._syncer = self._syncer, None
        self._in_flight = False
        if syncer is None:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError, ValueError):
                loop.remove_reader(syncer.fileno())
        syncer.close(0.1)
        if not syncer.answered:  # it cannot even start: not one new process per group
            self._inline_until = time.monotonic() + RETRY_INTERVAL

    def _on_reply(self) -> None:
        """The sync process answered (or died): settle the groups its sync covered, then
        write what came meanwhile and ask for the next sync."""
        with self._mutex:
            syncer = self._syncer
            if syncer is None:
                return
            reply = syncer.reply()
            if reply is None:
                # Its sync may or may not have run: a new process syncs them all again.
                log.error("audit sync process died", extra={"pid": syncer.pid})
                self._stop_syncer()
                self.sync_restarts += 1
            elif reply[0]:  # (group ids start at 1; 0: nothing to read after all)
                self._in_flight = False
                self._synced(*reply)
        if self._in_flight:
            return
        # Nothing held, pending or unsynced (the usual answer): nothing to write or sync.
        if self._held or (not self._pending and self._unsynced):
            self._held = False
            self._write_and_sync()
        elif self._pending and self._loop is not None:  # a group waiting for running requests
            self._group(self._loop)

    def submit(self, record: Any, done: Callable[[bool], None] | None = None) -> None:
        """Queue ``record`` from any thread; ``done(ok)`` is called from the writer thread."""
        self._queued.append((record, done))
        self._signal()

    def rotate(self) -> None:
        self._rotate = True
        self._signal()

    def healthy(self) -> bool:
        return self.error is None

    def flush(self, timeout: float = 5.0) -> bool:
        done = threading.Event()
        self._queued.append((None, lambda ok: done.set()))
        self._signal()
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        self._signal()
        self._thread.join(timeout)
        with self._mutex:
            self._stop_syncer()

    def _signal(self) -> None:
        """Wake the thread (at once if it waits, else after the batch it is writing)."""
        if self._wake.locked():
            with contextlib.suppress(RuntimeError):  # another thread released it just now
                self._wake.release()

    # -- the writer thread: other threads' records, checkpoints on time, probes, rotation ---

    def _run(self) -> None:
        # A batch thread gets its fair share of the CPU but does not preempt the event loop
        # each time a record wakes it.
        with contextlib.suppress(AttributeError, OSError):  # Linux only; never fatal
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        while True:
            self._wake.acquire(timeout=self._wait_time())  # takes the wake-up if one is pending
            closing = self._closing
            with self._mutex:
                batch: list[_Pending] = []
                for pending in (self._queued, self._pending) if closing else (self._queued,):
                    while pending:
                        batch.append(pending.popleft())
                if self._rotation_due():  # before a final batch: its checkpoint ends the file
                    self._rotate_now()
                written = self._next_group
                self._write_batch(batch, final=closing and not self._queued)
                if closing or self._next_group != written:  # the loop's own groups: its syncs
                    self._sync_inline()
                if not closing and self._rotation_due():
                    self._rotate_now()
                if closing and not self._queued:
                    self._close_fd()
                    return

    def _rotation_due(self) -> bool:
        due = self._rotate or bool(self._max_bytes and self._size >= self._max_bytes)
        self._rotate = False
        return due

    def _wait_time(self) -> float:
        if self.error is not None:
            return RETRY_INTERVAL
        if self._since_checkpoint == 0:
            return 1.0
        return max(0.05, self._last_checkpoint + self._interval - time.monotonic())

    # -- writing and syncing (under the mutex) ------------------------------------------------

    def _write_loop_group(self, batch: list[_Pending]) -> None:
        """:meth:`_write_batch` of the loop's own records: each waiter is a future of
        ``self._loop`` (see :meth:`_bind`), so the group's are handed over as one list, with
        no per-record type or loop checks."""
        fmt = self._format
        fields: list[bytes] = []
        futures: list[asyncio.Future[bool]] = []
        try:
            for record, future in batch:
                body = record if type(record) is bytes else fmt(record)
                fields.append(body if type(body) is bytes else orjson.dumps(body))
                futures.append(future)  # type: ignore[arg-type]
        except Exception:  # a record that cannot be formatted: the general path refuses it
            self._write_batch(batch)
            return
        waiters = _Waiters()
        loop = self._loop
        if futures and loop is not None:
            waiters.by_loop[loop] = futures
        self._write_group(fields, waiters, final=False)

    def _write_batch(self, batch: list[_Pending], *, final: bool = False) -> None:
        waiters, refused = _Waiters(), _Waiters()
        fields: list[bytes] = []
        for record, waiter in batch:
            told = waiters
            if record is not None:  # else a flush marker: told how the batch went
                try:
                    body = record if type(record) is bytes else self._format(record)
                    fields.append(body if type(body) is bytes else orjson.dumps(body))
                except Exception as exc:  # a bug in a record's fields: that request is refused
                    log.error(
                        "audit record not formatted", extra={"error_type": type(exc).__name__}
                    )
                    self._failed(1, "an audit record could not be formatted")
                    told = refused
            if isinstance(waiter, asyncio.Future):
                loop = waiter.get_loop()
                if loop in told.by_loop:
                    told.by_loop[loop].append(waiter)
                else:
                    told.by_loop[loop] = [waiter]
            elif waiter is not None:
                told.callbacks.append(waiter)
        refused.settle(False)
        self._write_group(fields, waiters, final=final)

    def _write_group(self, fields: list[bytes], waiters: _Waiters, *, final: bool) -> None:
        due = self._since_checkpoint + len(fields) >= self._every or (
            (fields or self._since_checkpoint)
            and (final or time.monotonic() - self._last_checkpoint >= self._interval)
        )
        # While failing, a checkpoint every RETRY_INTERVAL probes the file even when no
        # request comes (a pod out of its Service's endpoints gets none): the first one that
        # is written clears the error.
        probe = self.error is not None and not fields
        if not fields and not due and not probe:
            if not waiters.by_loop and not waiters.callbacks:
                return
            if self._unsynced:  # a flush marker: answered once the groups before it are
                state = self._unsynced[-1].state
                self._unsynced.append(_Group(self._next_group, waiters, [], 0, state))
                self._next_group += 1
            else:
                waiters.settle(self.error is None)
            return
        try:
            self._append(fields, waiters, checkpoint_after=bool(due) or probe, force=probe)
        except Exception as exc:  # never a dead writer with requests waiting on it
            log.error("audit batch failed", extra={"error_type": type(exc).__name__})
            self._failed(len(fields), f"audit writer error ({type(exc).__name__})")
            waiters.settle(False)

    def _append(
        self,
        fields: list[bytes],
        waiters: _Waiters,
        *,
        checkpoint_after: bool,
        force: bool = False,
    ) -> bool:
        """Write ``fields`` (and the lines due with them) to the page cache as one group,
        whose ``waiters`` are told once a sync covers it; False (and told) when it failed."""
        try:
            self._check_file()
        except OSError as exc:
            self._failed(len(fields), _reason(exc))
            waiters.settle(False)
            return False
        head = self._head
        lines: list[bytes] = []
        if self._open_line_due:
            line, head = chain.encode(head, self._open_fields())
            lines.append(line)
        if fields:
            records, head = chain.encode_all(head, fields)
            lines += records
        since = self._since_checkpoint + len(lines)  # the audit.open line is one too
        if checkpoint_after and (since or force) and self._signer is not None:
            try:
                cp = checkpoint.fields(
                    self.stream, head.seq + 1, head.hash, utc(time.time()), self._signer
                )
            except Exception as exc:  # the keyring refused: records still go, unsigned so far
                self._last_checkpoint = time.monotonic()  # tried again after an interval
                self.signing_error = f"checkpoint signing failed ({type(exc).__name__})"
                log.error("audit checkpoint not signed", extra={"error_type": type(exc).__name__})
            else:
                self.signing_error = None
                line, head = chain.encode(head, cp)
                lines.append(line)
                since = 0
        data = b"".join(lines)
        # tuple.__new__: a named tuple's own __new__ is a Python call, two per group.
        state = _new(_State, (self._size + len(data), head, since, False))
        group = _new(_Group, (self._next_group, waiters, lines, len(fields), state))
        self._next_group += 1
        self._unsynced.append(group)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._fail_unsynced(_reason(exc))
            return False
        self._size, self._head, self._since_checkpoint, self._open_line_due = state
        if since == 0:
            self._last_checkpoint = time.monotonic()
        return True

    def _sync_inline(self) -> bool:
        """Sync here and now (the thread, or the loop without a sync process)."""
        if not self._unsynced:
            return self.error is None
        upto = self._unsynced[-1].id
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            failed = exc.errno or errno.EIO
        else:
            failed = 0
        self._synced(upto, failed)
        return not failed

    def _synced(self, upto: int, failed: int) -> None:
        """A sync covering the groups up to ``upto`` returned ``failed`` (an errno, or 0)."""
        unsynced = self._unsynced
        if not unsynced or unsynced[0].id > upto:
            return  # an answer about groups already settled (synced again since)
        if failed:
            self._fail_unsynced(_reason(OSError(failed, os.strerror(failed))))
            return
        done: list[_Group] = []
        while unsynced and unsynced[0].id <= upto:
            done.append(unsynced.popleft())
        self._durable = done[-1].state
        self.syncs += 1
        self.error = None
        secondary = self._secondary
        for group in done:
            group.waiters.settle(True)
            if secondary is not None and group.lines:
                secondary.send(group.lines)

    def _fail_unsynced(self, reason: str) -> None:
        """A write or sync failed: every group not yet durable is lost (the file is cut back
        to the last durable line, so the chain stays whole) and its requests are told."""
        groups = list(self._unsynced)
        self._unsynced.clear()
        self._roll_back()
        self._failed(sum(group.records for group in groups), reason)
        for group in groups:
            group.waiters.settle(False)

    def _failed(self, lost: int, reason: str) -> None:
        if self.error != reason:
            log.error("audit records not written", extra={"reason": reason})
        if self.error is None:
            self._signal()  # the thread probes the file from now on (it may wait long else)
        self.error = reason
        self.failures += lost
        if lost:
            self._on_failure(lost)

    def _roll_back(self) -> None:
        """Cut what failed groups may have left (a torn line); if even that fails, drop the
        file: the next batch reopens the path and checks its tail."""
        durable = self._durable
        self._size, self._head, self._since_checkpoint, self._open_line_due = durable
        try:
            os.ftruncate(self._fd, durable.size)
            os.fsync(self._fd)
        except OSError:
            self._close_fd()

    # -- the file -----------------------------------------------------------------------------

    def _check_file(self) -> None:
        """Reopen the path when it no longer names the open file; refuse a read-only one."""
        if self._fd >= 0:
            try:
                found = os.stat(self.path)
            except FileNotFoundError:
                self._close_fd()
            else:
                if (found.st_dev, found.st_ino) != self._ino:
                    self._close_fd()
                elif not found.st_mode & 0o222:
                    raise PermissionError(13, "the audit file was made read-only")
        if self._fd < 0:
            self._open()

    def _open(self) -> None:
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self._ino is not None or self.path.endswith(f".p{os.getpid()}"):
                    raise
                # Another process (a sibling started without a worker index) writes this one.
                os.close(fd)
                self.stream = f"p{os.getpid()}"
                self.path = f"{self.base}.p{os.getpid()}"
                self._open()
                return
            found = os.fstat(fd)
            if not found.st_mode & 0o222:
                raise PermissionError(13, "the audit file is read-only")
            head = self._tail(fd)
        except _Reopen as torn:
            os.close(fd)
            if torn.head is not None and torn.head.seq >= self._head.seq:
                self._head = torn.head
            self._open()
            return
        except BaseException:
            os.close(fd)
            raise
        if head is not None and head.seq >= self._head.seq:
            self._head = head
        self._fd = fd
        self._ino = (found.st_dev, found.st_ino)
        # The sync process gets a description of its own, opened before any write: a writeback
        # error is reported once per open file description, so an inline sync on the writer's
        # descriptor (the thread's, a roll back's) can never take the error that the process's
        # sync must report, nor the reverse, whichever runs first.
        self._file += 1
        try:
            self._sync_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._sync_fd = -1  # no /proc: every sync inline, on the writer's descriptor
        self._size = os.fstat(fd).st_size
        self._open_line_due = True
        self._durable = _State(self._size, self._head, self._since_checkpoint, True)

    def _tail(self, fd: int) -> Head | None:
        """The head this file continues from: its last line, else the newest rotated file's."""
        try:
            last = chain.last_line(fd)
            if last is None:
                return self._rotated_head()
            return chain.head_of(last)
        except chain.BrokenTail:
            # A torn last line: keep the damaged file for the auditor and start a fresh one
            # that continues after the last complete record.
            head = _last_complete(fd)
            aside = f"{self.path}.torn-{int(time.time())}"
            os.rename(self.path, aside)
            log.error("audit file ends with a torn line", extra={"kept_as": aside})
            raise _Reopen(head) from None

    def _rotated_head(self) -> Head | None:
        rotated = sorted(glob.glob(glob.escape(self.path) + "." + "[0-9]" * 12))
        if not rotated:
            return None
        fd = os.open(rotated[-1], os.O_RDONLY | os.O_CLOEXEC)
        try:
            last = chain.last_line(fd)
            return None if last is None else chain.head_of(last)
        except chain.BrokenTail:
            return None
        finally:
            os.close(fd)

    def _open_fields(self) -> dict[str, Any]:
        return {
            "ts": utc(time.time()),
            "event": chain.OPEN,
            "stream": self.stream,
            "file": os.path.basename(self.path),
            "pid": os.getpid(),
        }

    def _rotate_now(self) -> None:
        if self._fd < 0 or self._size == 0:
            return
        if self._since_checkpoint:
            self._append([], _Waiters(), checkpoint_after=True)
        if not self._sync_inline() or self._unsynced:
            return
        rotated = f"{self.path}.{self._head.seq:012d}"
        try:
            os.rename(self.path, rotated)
            _sync_directory(self.path)
        except OSError as exc:
            log.error("audit file not rotated", extra={"reason": _reason(exc)})
            return
        self._close_fd()
        if self._append([], _Waiters(), checkpoint_after=False):  # the new file's audit.open line
            self._sync_inline()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            if self._unsynced:  # what was written to this file is synced (or failed) first
                self._sync_inline()
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        self._ino = None
        if self._sync_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._sync_fd)
            self._sync_fd = -1


class _Reopen(OSError):
    def __init__(self, head: Head | None) -> None:
        super().__init__("the audit file ended with a torn line")
        self.head = head


def _last_complete(fd: int) -> Head | None:
    size = os.fstat(fd).st_size
    data = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
    complete = data[: data.rfind(b"\n") + 1]
    lines = complete.splitlines()
    return chain.head_of(lines[-1]) if lines else None


def _sync_directory(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(exc: OSError) -> str:
    if isinstance(exc, PermissionError) and exc.strerror:
        return exc.strerror if "audit" in exc.strerror else "audit file not writable"
    name = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    return f"audit file not writable: {name}"
