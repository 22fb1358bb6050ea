"""The loop a worker process runs: read a frame, run it, answer, until the parent goes away.

The worker ignores SIGINT and SIGTERM (the parent decides when it stops: a Ctrl-C or a pod's
SIGTERM reaching the whole process group must not kill work the parent is draining) and exits
when its socket reaches end of stream: the parent closed it, or the parent died and the kernel
closed it. Nothing here prints a traceback: a task's arguments may be secrets.
"""

from __future__ import annotations

import contextlib
import io
import signal
import socket
from collections.abc import Callable
from typing import Any, cast

from service.errors import Internal
from service.pool.base import Call
from service.pool.wire import Kind, ProtocolError, dumps, loads, read_frame, write_frame

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def worker_main(
    sock: socket.socket, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]
) -> None:
    """Entry point of a worker process (the target of multiprocessing's Process)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    # The parent blocked these signals while starting us so that none lands before the lines
    # above; the mask is inherited, so unblock now that they are ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    with sock, sock.makefile("rb") as reader:
        if initializer is not None:
            try:
                initializer(*initargs)
            except BaseException as exc:
                _send(sock, Kind.INIT_FAILED, 0, dumps(type(exc).__name__))
                raise SystemExit(1) from None
        if not _send(sock, Kind.READY, 0, b""):
            return
        _serve(sock, reader)


def _serve(sock: socket.socket, reader: io.BufferedIOBase) -> None:
    while True:
        try:
            frame = read_frame(reader)
        except (OSError, ProtocolError):
            return  # a broken channel: the parent notices the exit and replaces us
        if frame is None:
            return  # end of stream: the parent closed the channel or died
        kind, msg_id, payload = frame
        if kind is Kind.TASK:
            reply = _run_task(payload)
        elif kind is Kind.BROADCAST:
            reply = _run_broadcast(payload)
        else:
            reply = (Kind.ERROR, dumps(Internal("unexpected frame")))
        del frame, payload  # do not keep a task's arguments alive while idle
        if not _send(sock, reply[0], msg_id, reply[1]):
            return


def _run_task(payload: bytes) -> tuple[Kind, bytes]:
    try:
        fn, args, kwargs = cast(Call, loads(payload))
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return Kind.ERROR, encode_error(exc)
    try:
        return Kind.RESULT, dumps(result)
    except Exception:
        return Kind.ERROR, dumps(Internal("task result cannot be sent back"))


def _run_broadcast(payload: bytes) -> tuple[Kind, bytes]:
    try:
        fn = cast(Callable[[], object], loads(payload))
        fn()
    except BaseException as exc:
        return Kind.BROADCAST_FAILED, encode_error(exc)
    return Kind.BROADCAST_DONE, b""


def encode_error(exc: BaseException) -> bytes:
    """Pickle ``exc`` if it crosses the boundary intact (same type); otherwise a generic
    Internal. Never the original text of an exception that cannot cross: it might hold secrets.
    Pickling drops the traceback, its frames and locals, and ``__cause__``/``__context__``."""
    if isinstance(exc, Exception):
        with contextlib.suppress(Exception):
            data = dumps(exc)
            if type(loads(data)) is type(exc):
                return data
    return dumps(Internal("task failed with an error that cannot be reported"))


def _send(sock: socket.socket, kind: Kind, msg_id: int, payload: bytes) -> bool:
    try:
        write_frame(sock, kind, msg_id, payload)
    except OSError:
        return False  # the parent is gone
    return True
