"""A replay store shared by every server worker of one host, without a server: an LMDB file.

LMDB is a memory-mapped B-tree with one writer at a time across processes (a robust mutex in
its lock file) and copy-on-write pages: a transaction is all or nothing, and a worker killed in
the middle of one leaves the last committed state, the next writer taking the lock over. A
nonce costs ~2.7 us of CPU here in one write transaction (SQLite in WAL mode: ~16 us; Redis,
with its round trip: ~60 us a request; docs/PERFORMANCE.md).

Layout. A nonce is stored as a 16-byte BLAKE2b digest of ``keyid:nonce`` (a collision would
refuse one fresh request, never accept a replay) in one of :data:`SLOTS` sub-databases chosen
by its request's ``created`` time: slot ``(created // BUCKET_SECONDS) % SLOTS``. A replay has
the same ``created`` (it is signed), so it meets its original in the same slot; a slot whose
minute has expired is emptied at once (LMDB frees its pages, ~0.3 ms for 400,000 nonces), so
there is no expiry per entry and no index to keep.

Bounded: the file never grows past ``max_bytes``; a full store refuses requests
(:class:`~service.auth.replay.StoreUnavailable`, 503) rather than forget a nonce early.

One write transaction per loop iteration: the nonces of the requests that reach the store
in the same iteration are written together (:class:`~service.auth.coalesce.TickBatcher`).
A commit writes its dirty pages with one system call each (~5 here: the slot's leaf, the
main database's, the free list's, the meta page), whatever the number of nonces, and
begins, reads the epoch and commits once; each nonce keeps its own answer (a replay within
the batch is refused like any other, since the transaction sees its own writes).

Epoch: the time the store was created. It is refused what was created before ``epoch +
max_skew`` (:class:`~service.auth.replay.StoreRecovering`), so a new store (a new pod, a
reboot, a deleted file) never accepts the replay of a request accepted before it. The file is
named after the kernel's boot id: after a reboot (when unsynchronised writes may have been
lost) a new store starts, with a new epoch, and the old file is removed.

The file lives in a private directory ``<directory>/cryptd-replay`` (mode 0700, owned by this
user, not a symlink: anything else is refused), the files inside are mode 0600. Give it a
memory-backed directory where possible (tmpfs, a Kubernetes ``emptyDir`` with
``medium: Memory``): nothing is written to a disk then, and a read-only root filesystem needs
nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing
import os
import stat
import struct
import tempfile
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Final, cast

import lmdb

from service.auth.coalesce import TickBatcher
from service.auth.replay import ReplayHealth, StoreRecovering, StoreUnavailable
from service.auth.signature import DEFAULT_MAX_AGE, DEFAULT_MAX_SKEW

BUCKET_SECONDS: Final = 60
SLOTS: Final = 72  # (SLOTS - 1) * BUCKET_SECONDS must exceed max_age + max_skew (3,600 + 300)
FORMAT: Final = b"cryptd-replay 1 60 72"
DEFAULT_MAX_BYTES: Final = 256 * 1024 * 1024  # ~6.5 million nonces (~39 bytes each)
SWEEP_SECONDS: Final = 10.0  # how often a process looks for expired slots
# Reserved on the filesystem when the store opens (~50,000 nonces): a light load keeps being
# served when the filesystem fills up (a development directory shared with the keyring).
PREALLOCATE_BYTES: Final = 2 * 1024 * 1024
SUBDIRECTORY: Final = "cryptd-replay"

_FORMAT_KEY: Final = b"format"
_EPOCH_KEY: Final = b"epoch"
_SLOT_KEYS: Final = tuple(b"slot:%02d" % i for i in range(SLOTS))
_BUCKET: Final = struct.Struct(">q")

Nonce = tuple[str, str, int]  # keyid, nonce, created
Verdict = bool | StoreUnavailable  # first time, replay, or this nonce's refusal
_Prepared = tuple[int, bytes, int, bytes]  # created, digest, bucket, packed bucket


def _prepare(keyid: str, nonce: str, created: int) -> _Prepared:
    digest = hashlib.blake2b(f"{keyid}:{nonce}".encode(), digest_size=16).digest()
    bucket = created // BUCKET_SECONDS
    return created, digest, bucket, _BUCKET.pack(bucket)


class ReplayStoreError(ValueError):
    """The store cannot be opened (directory not private, not writable, ...). The message
    names the path and what is wrong with it."""


class HostReplayStore:
    backend = "host"

    def __init__(
        self,
        directory: Path,
        *,
        max_age: int = DEFAULT_MAX_AGE,
        max_skew: int = DEFAULT_MAX_SKEW,
        max_bytes: int = DEFAULT_MAX_BYTES,
        epoch: int | None = None,
    ) -> None:
        """Open (or create) the store of this boot in ``directory``. ``epoch`` applies only
        when the store is created now: 0 tells that no request can have been accepted before
        it (the development setup creating its clients together with the store)."""
        if max_age + max_skew >= (SLOTS - 1) * BUCKET_SECONDS:
            raise ReplayStoreError(f"max_age + max_skew must stay under {SLOTS - 1} minutes")
        boot = boot_id()
        self.path = private_directory(directory) / f"{boot}.lmdb"
        self.max_age = max_age
        self.max_skew = max_skew
        self._next_sweep = 0.0
        self._batcher: TickBatcher[Nonce, Verdict] = TickBatcher(self._remember_batch)
        try:
            self._env = lmdb.open(
                str(self.path),
                subdir=False,
                map_size=max_bytes,
                max_dbs=SLOTS + 1,
                mode=0o600,
                # Never flushed: a process that dies keeps its committed writes (they are in the
                # page cache); a reboot starts a new file. Pages are written with pwrite(), not
                # through a writable mapping: a full filesystem is then an error the store
                # turns into a refusal, where a write to the mapping would kill the worker
                # with SIGBUS (writemap: ~4.6 against ~11 us here, under load).
                writemap=False,
                sync=False,
                metasync=False,
                readahead=False,
                meminit=False,
                lock=True,
            )
            self._env.reader_check()  # read slots of dead processes
            self._meta = self._env.open_db(b"meta")
            self._slots = [self._env.open_db(b"slot%02d" % i) for i in range(SLOTS)]
            with self._env.begin(write=True) as txn:
                self._initialise(txn, epoch)
        except lmdb.Error as exc:
            raise ReplayStoreError(f"replay store {self.path}: {exc}") from exc
        _remove_other_boots(self.path.parent, boot)
        _preallocate(self.path, min(max_bytes, PREALLOCATE_BYTES))

    def _initialise(self, txn: lmdb.Transaction[bytes], epoch: int | None) -> None:
        fmt = txn.get(_FORMAT_KEY, db=self._meta)
        if fmt is not None and fmt != FORMAT:
            # Another layout (another version): start afresh, with a new epoch.
            for slot in self._slots:
                txn.drop(slot, delete=False)
            txn.drop(self._meta, delete=False)
            fmt = None
            epoch = None
        if fmt is None:
            txn.put(_FORMAT_KEY, FORMAT, db=self._meta)
        start = math.ceil(time.time()) if epoch is None else epoch
        txn.put(_EPOCH_KEY, b"%d" % start, db=self._meta, overwrite=False)

    @property
    def epoch(self) -> int:
        with self._env.begin(db=self._meta) as txn:
            return _epoch(txn, self._meta)

    def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> Awaitable[bool]:
        # The batch's future itself, not a coroutine around it (the batcher raises a nonce's
        # refusal to its caller alone): one coroutine fewer a request, and one frame fewer for
        # the request's suspension for the batch to pass on its way out and back.
        return cast("Awaitable[bool]", self._batcher.submit((keyid, nonce, created)))

    def _remember_batch(self, items: Sequence[Nonce]) -> list[Verdict]:
        return self.remember_many_now(items, time.time())

    def remember_now(self, keyid: str, nonce: str, created: int, now: float) -> bool:
        """One nonce in a transaction of its own: True the first time, False for a replay;
        raises :class:`StoreRecovering` or :class:`StoreUnavailable`."""
        (verdict,) = self.remember_many_now([(keyid, nonce, created)], now)
        if isinstance(verdict, StoreUnavailable):
            raise verdict
        return verdict

    def remember_many_now(self, items: Sequence[Nonce], now: float) -> list[Verdict]:
        """Every nonce in one write transaction, a verdict each (in order): True the first
        time, False for a replay (of an earlier item too), or the refusal of that nonce
        alone (:class:`StoreRecovering`, or :class:`StoreUnavailable` for one older than the
        ring). Raises :class:`StoreUnavailable` when the store cannot write (full, broken):
        then none of them is remembered."""
        try:
            if time.monotonic() >= self._next_sweep:
                self._sweep(now)
            # Hashed before the write lock is taken: the lock is the one thing every worker
            # of the host waits for, so only the B-tree work is done holding it.
            prepared = [_prepare(keyid, nonce, created) for keyid, nonce, created in items]
            verdicts: list[Verdict] = []
            with self._env.begin(write=True) as txn:
                floor = _epoch(txn, self._meta) + self.max_skew
                claimed: dict[int, int] = {}
                for entry in prepared:
                    verdicts.append(self._put(txn, entry, floor, claimed))
            return verdicts
        except lmdb.MapFullError:
            raise StoreUnavailable("replay store full") from None
        except lmdb.Error as exc:
            raise StoreUnavailable(type(exc).__name__) from exc

    def _put(
        self,
        txn: lmdb.Transaction[bytes],
        entry: _Prepared,
        floor: int,
        claimed: dict[int, int],
    ) -> Verdict:
        """``claimed``: slot index -> the minute this transaction found or put there; the
        nonces of one batch share one or two minutes, so each slot is read once a batch."""
        created, digest, bucket, wanted = entry
        if created < floor:
            return StoreRecovering(floor - created)
        index = bucket % SLOTS
        if claimed.get(index) != bucket:
            held = txn.get(_SLOT_KEYS[index], db=self._meta)
            if held != wanted:
                if held is not None and _BUCKET.unpack(held)[0] > bucket:
                    # Older than the whole ring: the signature check lets none through.
                    return StoreUnavailable("request older than the replay store's window")
                # A minute SLOTS minutes old, long expired, makes room for this one.
                txn.drop(self._slots[index], delete=False)
                txn.put(_SLOT_KEYS[index], wanted, db=self._meta)
            claimed[index] = bucket
        return bool(txn.put(digest, b"", db=self._slots[index], overwrite=False))

    def _sweep(self, now: float) -> None:
        """Empty the slots whose minute no signature can still be valid for (a transaction
        of its own, so a full store can make room)."""
        self._next_sweep = time.monotonic() + SWEEP_SECONDS
        with self._env.begin(write=True) as txn:
            for key, slot in zip(_SLOT_KEYS, self._slots, strict=True):
                held = txn.get(key, db=self._meta)
                if held is None:
                    continue
                end = (_BUCKET.unpack(held)[0] + 1) * BUCKET_SECONDS  # after its last second
                if end + self.max_age + 1 < now:
                    txn.drop(slot, delete=False)
                    txn.delete(key, db=self._meta)

    def __len__(self) -> int:
        with self._env.begin() as txn:
            return sum(txn.stat(slot)["entries"] for slot in self._slots)

    async def ping(self) -> bool:
        return (await self.health()).ok

    async def health(self) -> ReplayHealth:
        try:
            remaining = math.ceil(self.epoch + self.max_skew - time.time())
        except lmdb.Error as exc:
            return ReplayHealth(False, f"replay store {self.path}: {type(exc).__name__}")
        if remaining > 0:
            return ReplayHealth(
                False,
                f"replay store: a new host store refuses requests signed before its epoch "
                f"for {remaining} s more",
                retry_after=remaining,
            )
        return ReplayHealth(True)

    def close(self) -> None:
        self._env.close()

    async def aclose(self) -> None:
        self.close()


def _epoch(txn: lmdb.Transaction[bytes], meta: lmdb._Database) -> int:
    raw = txn.get(_EPOCH_KEY, db=meta)
    if raw is None:  # cleared under us by a process of another version: refuse, safely
        return 2**62
    return int(raw)


def private_directory(base: Path) -> Path:
    """``base/cryptd-replay``, created mode 0700 if missing; refused unless it is a real
    directory owned by this user that nobody else may enter."""
    directory = base / SUBDIRECTORY
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        info = directory.lstat()
    except OSError as exc:
        raise ReplayStoreError(f"replay store directory {directory}: {exc.strerror}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ReplayStoreError(f"replay store directory {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise ReplayStoreError(f"replay store directory {directory} belongs to another user")
    if info.st_mode & 0o077:
        raise ReplayStoreError(
            f"replay store directory {directory} is open to other users "
            f"(mode {stat.S_IMODE(info.st_mode):04o}; it must be 0700)"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ReplayStoreError(f"replay store directory {directory} is not writable")
    return directory


def sibling_directory() -> Path | None:
    """Where workers that a process manager spawned without a store share one: a private
    directory named after their parent (``uvicorn --workers N`` or ``--reload`` start the app
    in multiprocessing children). None in a process nobody spawned, which is one worker.
    ``cryptd serve`` gives its workers a directory of its own and never needs this."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return None
    base = Path(tempfile.gettempdir()) / f"cryptd-replay-{os.geteuid()}-{parent.pid}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        info = base.lstat()
    except OSError as exc:
        raise ReplayStoreError(f"replay store directory {base}: {exc.strerror}") from exc
    # The name is predictable: a directory someone else made first is refused, not used.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ReplayStoreError(
            f"replay store directory {base} is not a private directory of this user: "
            "set CRYPTD_REPLAY_DIR or CRYPTD_REDIS_URL, or start the server with cryptd serve"
        )
    return base


def boot_id(proc: Path = Path("/proc")) -> str:
    """An identifier of the running kernel's boot (the boot time when the id is hidden)."""
    with contextlib.suppress(OSError):
        value = (proc / "sys/kernel/random/boot_id").read_text().strip()
        if value:
            return value
    with contextlib.suppress(OSError):
        for line in (proc / "stat").read_text().splitlines():
            if line.startswith("btime "):
                return "btime-" + line.split()[1]
    return "boot"


def _preallocate(path: Path, size: int) -> None:
    """Reserve the file's first ``size`` bytes (never shrinks it); skipped where impossible."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)


def _remove_other_boots(directory: Path, boot: str) -> None:
    """Files of earlier boots are stale: nobody can be using them now."""
    for path in directory.iterdir():
        if path.name.endswith((".lmdb", ".lmdb-lock")) and not path.name.startswith(f"{boot}."):
            with contextlib.suppress(OSError):
                path.unlink()
