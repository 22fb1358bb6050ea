"""Lines to a file descriptor from a background thread, so logging never blocks the loop.

A line is bytes, or a deferred (format, fields) pair the thread serializes in batches: the
request path pays a tuple and a deque append.
"""

from __future__ import annotations

import collections
import os
import select
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import orjson

from service.logs.fields import timestamp

WRITE_INTERVAL = 0.05
"""Seconds between writes when lines trickle in: a line reaches its destination within this."""
_WAKE_AT = 512  # queued lines that wake the writer early, under heavy load

Deferred = tuple[Callable[[tuple[Any, ...]], bytes], tuple[Any, ...]]
"""(format, fields): a line the writer thread serializes."""


class LineWriter:
    """Appends whole lines to a file descriptor from a background thread.

    Lines are grouped into writes that never split a line and, on a pipe, never exceed
    PIPE_BUF: such a write is atomic, so the lines of several worker processes sharing the
    container's stderr never interleave mid-line. A regular file is opened O_APPEND, which
    gives the same guarantee for larger writes.
    """

    def __init__(self, fd: int, *, max_pending: int = 100_000, owns_fd: bool = False) -> None:
        if not owns_fd:
            # A descriptor of its own (the same open file): whoever lent ``fd`` may close it
            # while lines are still due, and the number may then name a socket or a database
            # connection. Late lines still go out after close(); the duplicate goes with the
            # writer itself.
            fd = os.dup(fd)
            weakref.finalize(self, os.close, fd)
        self._fd = fd
        self._owns_fd = owns_fd
        mode = os.fstat(fd).st_mode
        self._chunk = select.PIPE_BUF if stat.S_ISFIFO(mode) else 64 * 1024
        self._max_pending = max_pending
        # Lines, deferred lines and the events flush() waits on, in order.
        self._pending: collections.deque[bytes | Deferred | threading.Event] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped = 0
        self.failed_writes = 0
        _after_fork(self, LineWriter._reset_after_fork)

    def write(self, line: bytes | Deferred, *, wait: bool = False) -> bool:
        """Queue one line (with its newline), or a (format, fields) pair that the writer thread
        turns into one: serializing there, in a tight loop, costs the process less than on the
        request path. ``fields`` must be immutable values captured now.

        When the queue is full, a line is dropped (and counted) unless ``wait``, in which case
        the caller waits for room: the audit stream slows the service down rather than lose a
        record."""
        if self._closing:  # late lines at shutdown: written at once, in the caller
            self._write_now(line)
            return True
        if self._thread is None:
            self._start()
        pending = self._pending
        if len(pending) >= self._max_pending:
            if not wait:
                self.dropped += 1
                return False
            while len(pending) >= self._max_pending and not self._closing:
                self._wake.set()
                time.sleep(0.001)
        pending.append(line)
        # The writer wakes up on its own every WRITE_INTERVAL; waking it for every line would
        # cost a thread switch (and a GIL handover) per request.
        if len(pending) >= _WAKE_AT and not self._wake.is_set():
            self._wake.set()
        return True

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cryptd-log", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        reported = 0
        while True:
            self._wake.wait(WRITE_INTERVAL)
            self._wake.clear()
            self._drain()
            if self.dropped != reported:
                reported = self.dropped
                notice = {
                    "ts": timestamp(time.time()),
                    "level": "warning",
                    "logger": "cryptd.logs",
                    "msg": "log lines dropped",
                    "dropped_total": reported,
                }
                self._write_all(orjson.dumps(notice, option=orjson.OPT_APPEND_NEWLINE))
            if self._closing and not self._pending:
                return

    def _drain(self) -> None:
        pending = self._pending
        chunk: list[bytes] = []
        size = 0
        while pending:
            item = pending.popleft()
            if isinstance(item, threading.Event):
                if chunk:
                    self._write_all(b"".join(chunk))
                    chunk, size = [], 0
                item.set()
                continue
            if isinstance(item, bytes):
                line = item
            else:
                try:
                    line = item[0](item[1])
                except Exception:  # a formatting bug loses that line, never the writer
                    self.dropped += 1
                    continue
            if chunk and size + len(line) > self._chunk:
                self._write_all(b"".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write_all(b"".join(chunk))

    def _write_now(self, line: bytes | Deferred) -> None:
        try:
            self._write_all(line if isinstance(line, bytes) else line[0](line[1]))
        except Exception:
            self.dropped += 1

    def _write_all(self, data: bytes) -> None:
        if self._fd < 0:
            self.dropped += 1
            return
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError:
            # Nowhere left to report it: count it (Audit.healthy() reads this).
            self.failed_writes += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every line queued before this call has been written (tests, shutdown)."""
        if self._thread is None:
            self._start()
        written = threading.Event()
        self._pending.append(written)
        self._wake.set()
        return written.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout)
        else:
            self._drain()
        if self._owns_fd:
            fd, self._fd = self._fd, -1  # never write to a number the OS may hand out again
            os.close(fd)
            self._owns_fd = False

    def _reset_after_fork(self) -> None:
        # A forked child has no writer thread, and the parent's pending lines are the parent's.
        self._pending = collections.deque()
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread = None


def _after_fork(writer: LineWriter, method: Any) -> None:
    reference = weakref.ref(writer)

    def reset() -> None:
        found = reference()
        if found is not None:
            method(found)

    os.register_at_fork(after_in_child=reset)
