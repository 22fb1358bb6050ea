"""The host's generation board: the newest keyring generation a worker of this host has
committed or verified, in one 8-byte cell of shared memory every server worker maps.

Why: a change that takes something away (a delete, a disable, ``decrypt_only``, a raised
``min_encryption_version``, a destruction) must be in force on every worker of the host
when it is acknowledged, not at the sibling's next store check. The worker that commits a
change raises the board before it answers; before a request uses a key, its worker compares
the board with the generation of the snapshot it serves (one aligned 8-byte load and an
integer comparison) and, when the board is ahead, loads the store first. No answer waits on
the siblings, no message crosses between workers, and a worker that was busy, slow or just
restarted cannot miss the change: it reads the board on its next request.

Only generations that a worker built or verified are written (a commit, a load, a refresh),
and the board never goes down, so it cannot make a worker serve something the store does not
hold. A board ahead of what the store gives back means the store lost an acknowledged change
(a database failover without synchronous replication): the workers then refuse rather than
serve the older keyring.

Layout of the file (``<directory>/keyring.board``, mode 0600): the generation (u64, native
order, offset 0) and this host's replica id (16 random bytes, offset 8), made by whoever
creates the file. Writers serialise on ``flock``; readers take no lock (an aligned 8-byte
load is atomic). Without a shared directory (one process) the board lives in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

FILENAME: Final = "keyring.board"
_GENERATION_BYTES: Final = 8
_ID_BYTES: Final = 16
SIZE: Final = _GENERATION_BYTES + _ID_BYTES


class Board:
    """One host's generation cell. ``cell[0]`` is the generation (read it on the hot path);
    :meth:`raise_to` is the only writer."""

    __slots__ = ("_buffer", "_fd", "_lock", "cell", "path", "replica")

    def __init__(self, path: Path | None = None) -> None:
        """Map ``path`` (created if missing), or keep the board in memory (``None``)."""
        self.path = path
        self._lock = threading.Lock()  # flock excludes other processes, not this one's threads
        self._fd: int | None = None
        buffer: mmap.mmap | bytearray
        if path is None:
            buffer = bytearray(SIZE)
            buffer[_GENERATION_BYTES:] = secrets.token_bytes(_ID_BYTES)
        else:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                with self._locked():
                    if os.fstat(self._fd).st_size < SIZE:
                        os.pwrite(self._fd, bytes(_GENERATION_BYTES), 0)
                        os.pwrite(self._fd, secrets.token_bytes(_ID_BYTES), _GENERATION_BYTES)
                buffer = mmap.mmap(self._fd, SIZE)
            except BaseException:
                os.close(self._fd)
                raise
        self._buffer = buffer
        self.cell = memoryview(buffer)[:_GENERATION_BYTES].cast("Q")
        self.replica = bytes(buffer[_GENERATION_BYTES:SIZE]).hex()

    @classmethod
    def in_directory(cls, directory: Path | None) -> Board:
        """The board every process given ``directory`` shares; in memory without one."""
        return cls(None if directory is None else directory / FILENAME)

    @property
    def generation(self) -> int:
        return int(self.cell[0])

    def raise_to(self, generation: int) -> bool:
        """Make the board at least ``generation``; True when this call moved it."""
        if self.cell[0] >= generation:
            return False
        with self._lock, self._locked():
            if self.cell[0] >= generation:
                return False
            self.cell[0] = generation
            return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.cell.release()
        if isinstance(self._buffer, mmap.mmap):
            self._buffer.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        where = "memory" if self.path is None else str(self.path)
        return f"<Board {where} generation={self.generation} replica={self.replica}>"
