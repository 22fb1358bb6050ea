"""The audit file: records made durable in groups before their requests are answered.

One job, kept in one module (over 400 lines): the writer thread, the file it owns and the
recovery of that file (torn tail, rotation, reopening) share state no other module may touch.

One thread per process owns the file. A request hands over its record and waits (without
blocking the event loop) until the thread's durable write that covers it returned (one
``pwritev2`` with ``RWF_DSYNC``, or a write and an ``fdatasync`` where the kernel lacks it):
every record waiting when a write starts shares that write and that sync (group
commit), so throughput holds while each answer still follows its record to the disk.

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
from typing import Any, Protocol

import orjson

from service.audit import chain, checkpoint
from service.audit.chain import Head

log = logging.getLogger("cryptd.audit")

RETRY_INTERVAL = 1.0  # seconds between probes of a file that could not be written
GROUP_DELAY = 0.001  # default: the most a record waits for running requests to join its sync
GROUP_MAX = 512  # records that start a sync without waiting for the others

Format = Callable[[Any], dict[str, Any] | bytes]
"""format(record) -> the line's fields (after seq and prev), run on the writer thread: a dict,
or those fields already serialized as one JSON object."""


class SecondarySink(Protocol):
    def send(self, lines: list[bytes]) -> None:
        """Take durable lines; must never block."""


def utc(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def stream_path(base: str, index: int) -> str:
    return base if index == 0 else f"{base}.w{index}"


class _Waiters:
    """The requests of one batch, settled with one call per event loop."""

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[bool]]] = {}
        self.callbacks: list[Callable[[bool], None]] = []

    def settle(self, ok: bool) -> None:
        for loop, futures in self.by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, futures, ok)
        for callback in self.callbacks:
            callback(ok)


def _resolve(futures: list[asyncio.Future[bool]], ok: bool) -> None:
    for future in futures:
        if not future.done():
            future.set_result(ok)


_Pending = tuple[Any, "asyncio.Future[bool] | Callable[[bool], None] | None"]


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
        event loop before the writer syncs (0: at the end of the loop pass)."""
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
        self._pending: collections.deque[_Pending] = collections.deque()
        # The writer's wake-up: a lock held while none is pending, released to wake it (any
        # thread may release a Lock). Half the CPU of an Event's set/wait/clear, which runs a
        # Condition in Python, once per group on each side.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._kick_due = False  # a wake-up is scheduled on the loop
        self._timer: asyncio.TimerHandle | None = None  # the group's deadline
        self._group_delay = group_delay
        self._running = 0  # requests begun on the loop whose records are not yet pending
        self._rotate = False
        self._closing = False
        self._fd = -1
        self._ino: tuple[int, int] | None = None
        self._size = 0
        self._head = Head()
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._open_line_due = False
        self.error: str | None = None  # why the last batch failed; None once one succeeds
        self.failures = 0
        self.signing_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="cryptd-audit", daemon=True)
        # At start: a file that cannot be opened is an error the operator sees now. Its
        # audit.open line is written at once, so no file of the trail is ever left empty.
        self._open()
        self._append([], checkpoint_after=False)
        self._thread.start()

    # -- the request side ---------------------------------------------------------------------

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
        future: asyncio.Future[bool] = loop.create_future()
        self._pending.append((record, future))
        if begun:
            self._running -= 1
        self._group(loop)
        return future

    def _group(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the writer once no other request of this loop is about to add its record (or
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
        self._signal()

    def submit(self, record: Any, done: Callable[[bool], None] | None = None) -> None:
        """Queue ``record`` from any thread; ``done(ok)`` is called from the writer thread."""
        self._pending.append((record, done))
        self._signal()

    def rotate(self) -> None:
        self._rotate = True
        self._signal()

    def healthy(self) -> bool:
        return self.error is None

    def flush(self, timeout: float = 5.0) -> bool:
        done = threading.Event()
        self._pending.append((None, lambda ok: done.set()))
        self._signal()
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        self._signal()
        self._thread.join(timeout)

    def _signal(self) -> None:
        """Wake the writer (at once if it waits, else after the batch it is writing)."""
        if self._wake.locked():
            with contextlib.suppress(RuntimeError):  # another thread released it just now
                self._wake.release()

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        # A batch thread gets its fair share of the CPU but does not preempt the event loop
        # each time a record wakes it: measured with one worker on one core, the loop's
        # involuntary context switches fell from 0.40 to 0.01 per request and audited
        # throughput rose 23 %; the records wait for the loop's next pause instead.
        with contextlib.suppress(AttributeError, OSError):  # Linux only; never fatal
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        while True:
            self._wake.acquire(timeout=self._wait_time())  # takes the wake-up if one is pending
            batch: list[_Pending] = []
            pending = self._pending
            while pending:
                batch.append(pending.popleft())
            closing = self._closing
            self._write_batch(batch, final=closing and not pending)
            if self._rotate or (self._max_bytes and self._size >= self._max_bytes):
                self._rotate = False
                self._rotate_now()
            if closing and not self._pending:
                self._close_fd()
                return

    def _wait_time(self) -> float:
        if self.error is not None:
            return RETRY_INTERVAL
        if self._since_checkpoint == 0:
            return 1.0
        return max(0.05, self._last_checkpoint + self._interval - time.monotonic())

    def _write_batch(self, batch: list[_Pending], *, final: bool = False) -> None:
        waiters, refused = _Waiters(), _Waiters()
        fields: list[bytes] = []
        for record, waiter in batch:
            told = waiters
            if record is not None:  # else a flush marker: told how the batch went
                try:
                    body = self._format(record)
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
        due = self._since_checkpoint + len(fields) >= self._every or (
            (fields or self._since_checkpoint)
            and (final or time.monotonic() - self._last_checkpoint >= self._interval)
        )
        # While failing, a checkpoint every RETRY_INTERVAL probes the file even when no
        # request comes (a pod out of its Service's endpoints gets none): the first one that
        # is written clears the error.
        probe = self.error is not None and not fields
        if not fields and not due and not probe:
            waiters.settle(self.error is None)
            return
        try:
            ok = self._append(fields, checkpoint_after=bool(due) or probe, force=probe)
        except Exception as exc:  # never a dead writer thread with requests waiting on it
            log.error("audit batch failed", extra={"error_type": type(exc).__name__})
            self._failed(len(fields), f"audit writer error ({type(exc).__name__})")
            ok = False
        waiters.settle(ok)

    def _append(self, fields: list[bytes], *, checkpoint_after: bool, force: bool = False) -> bool:
        try:
            self._check_file()
        except OSError as exc:
            self._failed(len(fields), _reason(exc))
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
        try:
            _write_durably(self._fd, data)
        except OSError as exc:
            self._roll_back()
            self._failed(len(fields), _reason(exc))
            return False
        self._head = head
        self._size += len(data)
        self._open_line_due = False
        if since == 0:
            self._last_checkpoint = time.monotonic()
        self._since_checkpoint = since
        self.error = None
        if self._secondary is not None:
            self._secondary.send(lines)
        return True

    def _failed(self, lost: int, reason: str) -> None:
        if self.error != reason:
            log.error("audit records not written", extra={"reason": reason})
        self.error = reason
        self.failures += lost
        if lost:
            self._on_failure(lost)

    def _roll_back(self) -> None:
        """Cut what a failed batch may have left (a torn line); if even that fails, drop the
        file: the next batch reopens the path and checks its tail."""
        try:
            os.ftruncate(self._fd, self._size)
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
        self._size = os.fstat(fd).st_size
        self._open_line_due = True

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
        if self._since_checkpoint and not self._append([], checkpoint_after=True):
            return
        rotated = f"{self.path}.{self._head.seq:012d}"
        try:
            os.rename(self.path, rotated)
            _sync_directory(self.path)
        except OSError as exc:
            log.error("audit file not rotated", extra={"reason": _reason(exc)})
            return
        self._close_fd()
        self._append([], checkpoint_after=False)  # the new file's audit.open line

    def _close_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        self._ino = None


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


# pwritev2's RWF_DSYNC (Linux 4.7): the write is durable when it returns, as after write +
# fdatasync (the kernel syncs the range written and the metadata needed to read it back), in
# one system call: one GIL release and re-take fewer per group, on a core the loop shares.
_DSYNC: int = getattr(os, "RWF_DSYNC", 0) if hasattr(os, "pwritev") else 0


def _write_durably(fd: int, data: bytes) -> None:
    """Append ``data`` to ``fd`` (opened ``O_APPEND``) and return once it is on disk."""
    global _DSYNC
    if _DSYNC:
        try:
            written = os.pwritev(fd, [data], -1, _DSYNC)  # -1: at the file offset (the end)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            _DSYNC = 0  # a kernel or file system without it: write + fdatasync from now on
        else:
            if written == len(data):
                return
            data = data[written:]  # a short write (a full disk): the rest, then a sync
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fdatasync(fd)


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
