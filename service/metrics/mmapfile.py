"""prometheus-client's per-process metric file, made safe on a full disk.

prometheus-client maps each process's file into memory and extends it with ``ftruncate``,
which reserves nothing: on a full tmpfs (where ``PROMETHEUS_MULTIPROC_DIR`` usually is) the
first write to a new page of the map is a SIGBUS, and the process dies — every server worker of
a host at its next new series, then every replacement the supervisor starts. Here a new entry's
bytes are reserved (``posix_fallocate``) before they are written, and a new file is made under
a temporary name, its first page written, before it takes its own name: a full disk is then an
``ENOSPC`` this class absorbs. A series that does not fit keeps its last value here, out of the
file, until space returns (tried at most once a second, at the file's next write); then it is
stored with that value. A scrape meanwhile misses those series and nothing else.

Installed by :func:`service.metrics.multiproc.activate`; the hot path (an existing series'
write) costs what prometheus-client's own does, one dictionary lookup and one 16-byte store,
plus one test of the waiting series.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from typing import Any, Final

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict

log = logging.getLogger("cryptd.metrics")

RETRY_INTERVAL: Final = 1.0  # seconds between attempts to place a series after ENOSPC
INITIAL_SIZE: Final = 1 << 16  # as prometheus-client's own initial file size
_HEADER: Final = struct.Struct("i")  # bytes used, at offset 0 (then 4 bytes of padding)
_TWO_DOUBLES: Final = struct.Struct("dd")  # value and timestamp of an entry
TEMPORARY_SUFFIX: Final = ".new"  # ".<name>.db.new" while a file is being made

_failing_lock = threading.Lock()
_failing: set[str] = set()  # files whose last placement failed: logged once per episode


class ReservedMmapedDict(MmapedDict):
    """prometheus-client's ``MmapedDict`` that never writes to a page it has not reserved."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if read_mode:
            super().__init__(filename, read_mode=True)  # type: ignore[no-untyped-call]
            return
        self._fname = filename
        self._f: Any = None
        self._m: Any = None
        self._positions: dict[str, int] = {}
        self._used = 8
        self._capacity = 0
        self._retry_at = 0.0
        self._pending: dict[str, tuple[float, float]] = {}  # series not in the file yet
        self._attach()

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        pos = self._positions.get(key)
        if pos is None and (pos := self._place(key)) is None:
            self._pending[key] = (value, timestamp)  # written when space returns
            return
        self._m[pos : pos + 16] = _TWO_DOUBLES.pack(value, timestamp)
        if self._pending:  # this file is writable again: store what waited
            self._flush_pending()

    def read_value(self, key: str) -> tuple[float, float]:
        pos = self._positions.get(key)
        if pos is None and (pos := self._place(key)) is None:
            return self._pending.get(key, (0.0, 0.0))
        found: tuple[float, float] = _TWO_DOUBLES.unpack_from(self._m, pos)
        return found

    def _init_value(self, key: str) -> None:
        """Reserve the entry's bytes first: ENOSPC here instead of SIGBUS at the write."""
        length = len(key.encode("utf-8"))
        size = 4 + length + (8 - (length + 4) % 8) + 16  # prometheus-client's entry layout
        os.posix_fallocate(self._f.fileno(), self._used, size)
        super()._init_value(key)  # type: ignore[no-untyped-call]

    def _place(self, key: str) -> int | None:
        """The entry's offset, made now if the disk allows; None while it does not."""
        now = time.monotonic()
        if now < self._retry_at:
            return None
        if self._m is None and not self._attach():
            return None
        pos = self._positions.get(key)
        if pos is not None:
            return pos
        try:
            self._init_value(key)
        except OSError as exc:
            self._retry_at = now + RETRY_INTERVAL
            _failed(self._fname, exc)
            return None
        _recovered(self._fname)
        found: int = self._positions[key]
        waited = self._pending.pop(key, None)
        if waited is not None:
            self._m[found : found + 16] = _TWO_DOUBLES.pack(*waited)
        return found

    def _flush_pending(self) -> None:
        for key in list(self._pending):
            if self._place(key) is None:
                return

    def _attach(self) -> bool:
        """Open (making it first if need be) and map the file; False on a full disk."""
        try:
            if not os.path.exists(self._fname):
                _create(self._fname)
            super().__init__(self._fname)  # type: ignore[no-untyped-call]
        except OSError as exc:
            if self._f is not None:
                self._f.close()
            self._f = self._m = None
            self._retry_at = time.monotonic() + RETRY_INTERVAL
            _failed(self._fname, exc)
            return False
        return True


def _create(filename: str) -> None:
    """A new file with its header written (its first page allocated) and its full initial
    size, made under a temporary name: a scrape never reads a file without a header."""
    directory, name = os.path.split(filename)
    temporary = os.path.join(directory, f".{name}{TEMPORARY_SUFFIX}")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        header = _HEADER.pack(8) + bytes(4)
        if os.pwrite(fd, header, 0) != len(header):
            raise OSError(28, os.strerror(28))
        os.ftruncate(fd, INITIAL_SIZE)  # the rest is reserved entry by entry (_init_value)
        os.rename(temporary, filename)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    os.close(fd)


def _failed(filename: str, exc: OSError) -> None:
    with _failing_lock:
        first = filename not in _failing
        _failing.add(filename)
    if first:
        log.warning(
            "metrics file full: new series kept out of it until space returns",
            extra={"file": os.path.basename(filename), "reason": os.strerror(exc.errno or 0)},
        )


def _recovered(filename: str) -> None:
    if filename in _failing:
        with _failing_lock:
            _failing.discard(filename)
        log.info("metrics file writable again", extra={"file": os.path.basename(filename)})


def install() -> None:
    """Make prometheus-client's multiprocess values use :class:`ReservedMmapedDict` (its
    value class looks the name up in ``prometheus_client.values`` each time it opens a file)."""
    values.MmapedDict = ReservedMmapedDict  # type: ignore[attr-defined]
