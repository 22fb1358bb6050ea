"""The file key store: the keyring document as one JSON file.

Writes are atomic (temporary file in the same directory, fsync, rename, fsync of the
directory) and serialised between processes by an advisory lock on the sibling file
``<name>.lock``. Replicas on one node share the file; across nodes use PostgreSQL.

A writer killed between creating its temporary file and the rename leaves that file, a full
copy of the keyring, beside it: :meth:`FileKeyStore.remove_leftovers` removes such files
under the same lock, when no writer can be mid-write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from collections.abc import AsyncGenerator, Collection, Hashable, Iterator
from pathlib import Path

import orjson

from service.fileio import atomic_write, file_stamp
from service.keys.document import RawDocument
from service.keys.store import IntegrityError, Notice, StoreUnavailable


class FileKeyStore:
    backend = "file"

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def description(self) -> str:
        return f"file {self.path}"

    def read(self) -> RawDocument | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"the keyring file cannot be read ({exc.strerror})") from None
        return parse(data)

    def read_keys(self, base: RawDocument, names: Collection[str]) -> RawDocument | None:
        return self.read()  # one file: the whole document is the only read there is

    def stamp(self) -> Hashable:
        return file_stamp(self.path)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_FileTransaction]:
        with self._flock(".lock", blocking=True):
            yield _FileTransaction(self)

    @contextlib.contextmanager
    def try_lock(self, purpose: str) -> Iterator[bool]:
        with self._flock(f".{purpose}.lock", blocking=False) as held:
            yield held

    def notifications(self) -> AsyncGenerator[Notice, None] | None:
        return None  # polled: one stat per interval

    def announce(self, replica: str, generation: int) -> None:
        pass  # one replica per host: the board says it all

    def server_clock(self) -> None:
        return None  # a file has no clock of its own to compare this host's with

    def remove_leftovers(self) -> int:
        # Every writer holds the lock from creating its temporary file to the rename, so with
        # the lock held here, any file of that name pattern belongs to a writer that died.
        pattern = re.compile(rf"\.{re.escape(self.path.name)}\.[A-Za-z0-9_]+\.tmp")
        directory = self.path.parent
        removed = 0
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self._flock(".lock", blocking=True))
            except StoreUnavailable:
                return 0  # no directory, or a read-only one: no write can have happened here
            for name in os.listdir(directory):
                candidate = directory / name
                if not pattern.fullmatch(name):
                    continue
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(candidate.lstat().st_mode):  # never follow a link
                        candidate.unlink()
                        removed += 1
        return removed

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def _flock(self, suffix: str, *, blocking: bool) -> Iterator[bool]:
        lock_path = self.path.with_name(self.path.name + suffix)
        try:
            handle = open(lock_path, "a+b")  # noqa: SIM115 - closed below, after the unlock
        except OSError as exc:
            raise StoreUnavailable(f"the keyring lock cannot be taken ({exc.strerror})") from None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not blocking:
                    yield False
                    return
                raise StoreUnavailable(
                    f"the keyring lock cannot be taken ({exc.strerror})"
                ) from None
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


class _FileTransaction:
    def __init__(self, store: FileKeyStore) -> None:
        self._store = store

    def read(self) -> RawDocument | None:
        return self._store.read()

    def write(self, document: RawDocument) -> None:
        try:
            atomic_write(self._store.path, render(document))
        except OSError as exc:
            raise StoreUnavailable(
                f"the keyring file could not be written ({exc.strerror})"
            ) from None


def parse(data: bytes) -> RawDocument:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise IntegrityError("the keyring file is not JSON") from None
    if not isinstance(raw, dict):
        raise IntegrityError("the keyring file is not a JSON object")
    return raw


def render(document: RawDocument) -> bytes:
    """Indented, keys in document order (the MAC does not depend on the layout)."""
    return orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n"
