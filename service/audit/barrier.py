"""The durability barrier of the audit file, run in a process of its own.

The event loop writes each group of records to the page cache itself (one ``write``, a few
microseconds) and asks this process to ``fdatasync`` the file: a process shares no GIL with the
worker, so the loop never waits for a thread to take it (measured on one core, those hand-overs
were the trail's main cost, not the disk). The loop learns the answer by watching the socket.

The process is started with an empty environment and a fresh interpreter (``exec``, not a
``fork`` of the worker's memory), and receives nothing but the audit file's descriptor: no key
material ever reaches it. It ends when the worker closes its end of the socket, and at once
if the worker dies (``PR_SET_PDEATHSIG``), even while a sync is running.

Protocol (``SOCK_SEQPACKET``): the worker sends ``upto`` (8 bytes: the last group written),
with the file's descriptor attached when it changed; the process answers ``upto`` and the
``errno`` of the sync (0: durable).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import subprocess
import sys
import time

_REQUEST = struct.Struct("=Q")
_REPLY = struct.Struct("=Qi")


class SyncProcess:
    """The worker's side: one process, one outstanding request at a time."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",  # isolated: no environment variable, no user site, no cwd on the path
                    "-S",  # no site-packages: the standard library is all it needs
                    os.path.abspath(__file__),
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
                env={},  # nothing of the worker's environment (no key, no password)
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        self.socket = mine
        self.started = time.monotonic()
        self.file = 0  # which of the writer's files the descriptor it holds is (0: none)
        self.answered = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def fileno(self) -> int:
        return self.socket.fileno()

    def request(self, upto: int, fd: int, file: int) -> None:
        """Ask for a sync of ``fd`` covering the groups up to ``upto``; ``file`` numbers the
        writer's files (``fd`` is sent along when it changed)."""
        message = _REQUEST.pack(upto)
        if file != self.file:
            socket.send_fds(self.socket, [message], [fd])
            self.file = file
        else:
            self.socket.send(message)

    def reply(self) -> tuple[int, int] | None:
        """The answer that arrived (``upto``, ``errno``; ``(0, 0)`` when none had): one read,
        as one sync at a time is asked for. None once the process is gone."""
        try:
            data = self.socket.recv(_REPLY.size)
        except BlockingIOError:
            return 0, 0
        except OSError:
            return None
        if len(data) != _REPLY.size:
            return None  # end of file: the process died
        self.answered += 1
        upto, failed = _REPLY.unpack(data)
        return upto, failed

    def close(self, timeout: float = 1.0) -> None:
        self.socket.close()  # the process reads the end of file and exits
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:  # stuck in a sync: it would never answer anyway
            self.process.kill()
            self.process.wait()


def _die_with(parent: int) -> None:
    try:
        import ctypes  # here only: the worker never loads it for this

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # not Linux: the end of file still ends it
        pass
    if os.getppid() != parent:  # the worker died before prctl took effect
        sys.exit(0)


def serve(channel: socket.socket) -> None:
    fd = -1
    while True:
        message, fds, _, _ = socket.recv_fds(channel, _REQUEST.size, 4)
        if not message:
            return
        for extra in fds[:-1]:
            os.close(extra)
        if fds:
            if fd >= 0:
                os.close(fd)
            fd = fds[-1]
        (upto,) = _REQUEST.unpack(message)
        try:
            os.fdatasync(fd)
        except OSError as exc:
            failed = exc.errno or errno.EIO
        else:
            failed = 0
        channel.send(_REPLY.pack(upto, failed))


if __name__ == "__main__":
    _die_with(int(sys.argv[2]))
    with contextlib.suppress(ConnectionError, KeyboardInterrupt):
        serve(socket.socket(fileno=int(sys.argv[1])))
