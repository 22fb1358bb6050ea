"""Structured JSON logs on stderr, one access line per request, and the audit stream.

Every line is one JSON object (orjson). Lines go through a queue to a writer thread, one per
destination, so a slow or blocked stderr pipe or disk never stalls the event loop. Access and
audit lines are queued as tuples of fields and serialized by the writer thread in batches: the
request path pays a tuple and a deque append.

What is never logged: request or response bodies, key material, secrets, signatures, exception
messages (library messages can quote their input: a validation error repeats the field it
refused) and ``bytes`` values of any kind. Log calls carry identifiers and outcomes only.
"""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing.util
import os
import select
import stat
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from service.asgi import Scope

LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

WRITE_INTERVAL = 0.05
"""Seconds between writes when lines trickle in: a line reaches its destination within this."""
_WAKE_AT = 512  # queued lines that wake the writer early, under heavy load

Deferred = tuple[Callable[[tuple[Any, ...]], bytes], tuple[Any, ...]]
"""(format, fields): a line the writer thread serializes."""

_PLAIN_TYPES = (str, int, float, bool, type(None))

# Attributes every LogRecord has; anything else came from ``extra=`` and is a field of the line
# (except uvicorn's ``color_message``: the message again, with terminal colour codes).
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",
}


# ".000Z" to ".999Z", and ".1000Z" ((now - second) * 1000 can round up to 1000 in the epoch's
# first second): an index costs half of formatting the milliseconds for every line.
_MILLISECONDS = tuple(f".{ms:03d}Z" for ms in range(1001))


def _timestamp(now: float, _cache: list[Any] = [-1, ""]) -> str:  # noqa: B006 - per-second cache
    """RFC 3339 UTC with milliseconds; the date-time part is formatted once per second."""
    second = int(now)
    if second != _cache[0]:
        _cache[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _cache[0] = second
    day_and_time: str = _cache[1]
    return day_and_time + _MILLISECONDS[int((now - second) * 1000)]


def _plain(value: object) -> object:
    """``value`` if it is a JSON scalar or a flat list of them; otherwise nothing is logged."""
    if isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, _PLAIN_TYPES) for v in value):
        return list(value)
    return None


class LineWriter:
    """Appends whole lines to a file descriptor from a background thread.

    Lines are grouped into writes that never split a line and, on a pipe, never exceed
    PIPE_BUF: such a write is atomic, so the lines of several worker processes sharing the
    container's stderr never interleave mid-line. A regular file is opened O_APPEND, which
    gives the same guarantee for larger writes.
    """

    def __init__(self, fd: int, *, max_pending: int = 100_000, owns_fd: bool = False) -> None:
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
                    "ts": _timestamp(time.time()),
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


class JsonHandler(logging.Handler):
    """A logging handler writing one JSON object per record: ts, level, logger, msg, the
    ``extra=`` fields that are plain scalars, and for exceptions their type and frames only."""

    def __init__(self, writer: LineWriter) -> None:
        super().__init__()
        self._writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line: dict[str, object] = {
                "ts": _timestamp(record.created),
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
            }
            for name, value in record.__dict__.items():
                if name not in _RECORD_ATTRIBUTES and name not in line:
                    plain = _plain(value)
                    if plain is not None:
                        line[name] = plain
            if record.exc_info and record.exc_info[0] is not None:
                line["exc_type"] = record.exc_info[0].__name__
                frames = traceback.extract_tb(record.exc_info[2])
                line["frames"] = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames]
            self._writer.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        except Exception:  # a log call must never raise into the code that logs
            self.handleError(record)


class AccessLog:
    """One line per HTTP request, fed by the metrics timing middleware (which measures once for
    both). Fields come from the request scope; the API puts the request-scoped ones in
    ``scope["state"]``: request_id, client (``.id``), key, operation, key_version."""

    def __init__(self, writer: LineWriter) -> None:
        self._writer = writer

    def __call__(self, scope: Scope, route: str, status: int, seconds: float) -> None:
        state = scope.get("state") or {}
        remote = scope.get("client")
        fields = (
            time.time(),
            state.get("request_id"),
            _client_id(state.get("client")),
            scope.get("method"),
            route,
            status,
            seconds,
            state.get("key"),
            state.get("operation"),
            state.get("key_version"),
            remote[0] if remote else None,
        )
        self._writer.write((_format_access, fields))


def _client_id(client: object) -> object:
    """The authenticated client's id: ``.id`` (the API's Caller) or ``.client_id``."""
    found = getattr(client, "id", None)
    return found if found is not None else getattr(client, "client_id", None)


def _format_access(fields: tuple[Any, ...]) -> bytes:
    when, request_id, client, method, route, status, seconds, key, operation, version, remote = (
        fields
    )
    line = {
        "ts": _timestamp(when),
        "level": "info",
        "logger": "cryptd.access",
        "msg": "request",
        "request_id": _plain(request_id),
        "client": _plain(client),
        "method": _plain(method),
        "route": route,
        "status": status,
        "latency_ms": round(seconds * 1000.0, 3),
        "key": _plain(key),
        "operation": _plain(operation),
        "key_version": _plain(version),
        "remote": _plain(remote),
    }
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


_SCALAR_VERSION = (int, type(None))  # a tuple: `int | None` would build a union per call


class Audit:
    """Who did what with which key and version, when, and how it ended.

    One line per key-management action and per decrypt/sign/rewrap request (a batch is one
    line with its item count and the versions it used). Never blocks on I/O: lines go through
    the writer thread. Only when ``max_pending`` lines are already waiting (the destination is
    stuck) does a caller wait, rather than drop a record.
    """

    def __init__(self, writer: LineWriter | None) -> None:
        self._writer = writer
        self.enabled = writer is not None

    def record(
        self,
        event: str,
        *,
        client: str | None,
        key: str,
        outcome: str,
        key_version: int | Sequence[int] | None = None,
        request_id: str | None = None,
        items: int = 1,
        target_key: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        """``event``: decrypt, sign, rewrap, key.create, key.rotate, key.update, key.state,
        key.delete, key.cancel_deletion, key.destroy, …
        ``outcome``: ok, error, partial (some batch items failed), denied, scheduled (a
        deletion with a waiting period), or an error code. ``detail``: fields of the event
        (a state change's ``state`` and ``previous_state``, a ``deletion_date``)."""
        writer = self._writer
        if writer is None:
            return
        if not isinstance(key_version, _SCALAR_VERSION):
            key_version = tuple(sorted(set(key_version)))
        fields = (time.time(), event, outcome, client, key, key_version, items, request_id)
        writer.write((_format_audit, (*fields, target_key, detail)), wait=True)

    def healthy(self) -> bool:
        """False once a write to the audit destination failed (for the readiness probe)."""
        return self._writer is None or self._writer.failed_writes == 0

    def flush(self, timeout: float = 5.0) -> None:
        if self._writer is not None:
            self._writer.flush(timeout)


def _format_audit(fields: tuple[Any, ...]) -> bytes:
    when, event, outcome, client, key, key_version, items, request_id, target_key, detail = fields
    if target_key is None and not detail:
        # The request's lines: all but the time and the request id repeat from line to line.
        repeated = (event, outcome, client, key, key_version, items)
        middle = _audit_middles.get(repeated)
        if middle is None:
            middle = _audit_middle(repeated)
        return b"".join(
            (b'{"ts":"', _timestamp(when).encode(), middle, orjson.dumps(request_id), b"}\n")
        )
    line = _audit_line(when, event, outcome, client, key, key_version, items, request_id)
    if target_key is not None:
        line["target_key"] = target_key
    if detail:
        line.update({name: value for name, value in detail.items() if name not in line})
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _audit_line(
    when: float | None,
    event: str,
    outcome: str,
    client: str | None,
    key: str,
    key_version: int | tuple[int, ...] | None,
    items: int,
    request_id: str | None,
) -> dict[str, Any]:
    return {
        "ts": None if when is None else _timestamp(when),
        "level": "info",
        "logger": "cryptd.audit",
        "msg": "audit",
        "event": event,
        "outcome": outcome,
        "client": client,
        "key": key,
        "key_version": list(key_version) if isinstance(key_version, tuple) else key_version,
        "items": items,
        "request_id": request_id,
    }


# What the lines of one (event, outcome, client, key, version, items) write between the time and
# the request id, serialized once: bounded, since key names and version lists come from clients.
_audit_middles: dict[tuple[Any, ...], bytes] = {}
_AUDIT_MIDDLES_MAX = 4096


def _audit_middle(repeated: tuple[Any, ...]) -> bytes:
    event, outcome, client, key, key_version, items = repeated
    whole = orjson.dumps(_audit_line(None, event, outcome, client, key, key_version, items, None))
    # {"ts":null,...,"items":N,"request_id":null} -> ",...,"items":N,"request_id":"
    middle = b'"' + whole[len(b'{"ts":null') : -len(b"null}")]
    if len(_audit_middles) >= _AUDIT_MIDDLES_MAX:
        _audit_middles.clear()
    _audit_middles[repeated] = middle
    return middle


@dataclass
class LogSetup:
    """What :func:`configure_logging` built: pass ``access_log`` to the request timer
    (service/api/timing.py) and ``audit`` to whatever manages keys and runs decrypt/sign;
    ``close()`` at shutdown."""

    access_log: AccessLog | None
    audit: Audit
    writers: list[LineWriter]

    def flush(self, timeout: float = 5.0) -> None:
        for writer in self.writers:
            writer.flush(timeout)

    def close(self) -> None:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, JsonHandler)]:
            root.removeHandler(handler)
        for writer in self.writers:
            writer.close()


_current: LogSetup | None = None

_URL_LOGGERS = ("httpx", "httpcore", "urllib3")


def configure_logging(
    level: str,
    access_log: bool,
    audit_target: str,
    *,
    stderr_fd: int | None = None,
) -> LogSetup:
    """Install JSON logging on the root logger at ``level``; build the access log (None when
    off or when ``level`` hides info lines) and the audit stream (``"stderr"``, ``"off"`` or a
    file path, opened append-only, mode 0600). Calling it again replaces the previous setup.

    Call it in every process that logs (each server worker; pool workers log little and may
    inherit it through fork). Servers should not install their own access log or handlers
    (uvicorn: ``log_config=None, access_log=False``).
    """
    global _current
    numeric = LEVELS.get(level.lower())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    if _current is not None:
        _current.close()
    stderr = LineWriter(stderr_fd if stderr_fd is not None else _stderr_fd())
    writers = [stderr]
    if audit_target == "off":
        audit = Audit(None)
    elif audit_target == "stderr":
        audit = Audit(stderr)
    else:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        audit_writer = LineWriter(os.open(Path(audit_target), flags, 0o600), owns_fd=True)
        writers.append(audit_writer)
        audit = Audit(audit_writer)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, JsonHandler) or _writes_to_console(handler):
            root.removeHandler(handler)  # plain-text duplicates of every line
    root.addHandler(JsonHandler(stderr))
    root.setLevel(numeric)
    for name in _URL_LOGGERS:  # they log full URLs, query strings included, at info and debug
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    access = AccessLog(stderr) if access_log and numeric <= logging.INFO else None
    _current = LogSetup(access_log=access, audit=audit, writers=writers)
    return _current


def _writes_to_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return type(handler) is logging.StreamHandler and stream in (sys.stderr, sys.stdout)


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by a test harness
        return 2


def _close_at_exit() -> None:
    if _current is not None:
        _current.close()


atexit.register(_close_at_exit)
# Processes started by multiprocessing (uvicorn's workers) end with os._exit(), which skips
# atexit: their finalizers run instead, so the last lines still reach stderr.
multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=0)


def _after_fork(writer: LineWriter, method: Any) -> None:
    reference = weakref.ref(writer)

    def reset() -> None:
        found = reference()
        if found is not None:
            method(found)

    os.register_at_fork(after_in_child=reset)
