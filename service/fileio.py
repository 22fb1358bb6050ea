"""File helpers shared by the keyring and the clients file: atomic replacement and a cheap
change stamp for hot reload."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

FileStamp = tuple[int, int, int, int, int]


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` so readers see the old or the new content, never a mix: temp file in the
    same directory (created with ``mode``), fsync, rename, fsync of the directory."""
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def file_stamp(path: Path) -> FileStamp | None:
    """What changes when the file is replaced; follows symlinks, so a Kubernetes Secret update
    (an atomic swap of the ``..data`` link) shows as a new inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
