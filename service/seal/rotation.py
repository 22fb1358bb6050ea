"""Master-key rotation: a new master key where the seal keeps it, every key version rewrapped
under it, online. ``static``: the file ``CRYPTD_MASTER_KEY_FILE`` names; ``pkcs11``: the sealed
master key file, the new key sealed by the same token key (:class:`SealedKeyFiles`, the same
 steps with ``<sealed file>.next`` and ``<sealed file>.retired-<key id>``); ``transit``: the
same, the new key wrapped by the Transit key's latest version; ``shamir``: a new split in the
seal file (service/seal/shamir_rotation.py, the same steps).

The order of writes makes a SIGKILL at any moment harmless:

1. the new key is written (atomically, mode 0600) beside the current one as ``<file>.next``;
2. the key store is rewritten in one transaction (one atomic file replace, or one PostgreSQL
   transaction) under the new key and tagged with its id (``master_key_id``);
3. the current key is appended to ``<file>.retired`` (backups made under it still restore),
   then ``<file>.next`` is renamed over ``<file>``.

Before step 2 commits the store is under the old key; after, under the new one, which is in
``<file>.next`` or ``<file>``: every process finds it there by the id the store names
(:class:`StaticKeyFiles` is their :class:`~service.keys.masterkey.MasterKeySource`). A start
or a later rotation (:func:`settle`) finishes step 3 when the store names the staged key and
removes a staged key the store never used. Both hold the store's ``master-key-rotation``
lock, so one rotation runs at a time across every replica.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

from service.config import SealSettings, decode_master_key
from service.errors import Conflict
from service.fileio import atomic_write
from service.keys.masterkey import MasterKey
from service.keys.snapshot import Snapshot
from service.keys.store import KeyStore
from service.seal import sealedfile
from service.seal.base import Seal, SealError

if TYPE_CHECKING:
    from service.seal.pkcs11 import Pkcs11Seal  # the binding is an optional extra
    from service.seal.shamir_rotation import ShamirKeyFiles  # so is shamir-mnemonic
    from service.seal.transit import TransitSeal

log = logging.getLogger("cryptd.seal")

LOCK = "master-key-rotation"


def staged_path(path: Path) -> Path:
    return path.with_name(path.name + ".next")


def retired_path(path: Path) -> Path:
    return path.with_name(path.name + ".retired")


def _read_key(path: Path) -> MasterKey | None:
    try:
        return MasterKey(decode_master_key(path.read_text(), str(path)))
    except (OSError, ValueError):
        return None  # absent, unreadable or damaged: not a key anything may be opened with


def _read_retired(path: Path) -> list[bytes]:
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SealError(f"{path} cannot be read ({exc.strerror})") from None
    keys = []
    for line in lines:
        with contextlib.suppress(ValueError, binascii.Error):
            keys.append(decode_master_key(line, str(path)))
    return keys


class StaticKeyFiles:
    """The static seal's key files: current, staged (a rotation under way) and retired."""

    def __init__(self, path: Path) -> None:
        # Through a symlink to a shared volume, the files beside the real one: a rename over
        # the link itself would leave the other hosts on the old key.
        self.path = path.resolve()
        self.staged = staged_path(self.path)
        self.retired = retired_path(self.path)

    def find(self, key_id: str) -> MasterKey | None:
        # The staged file first: a promotion between the two reads moves it to the path.
        for candidate in (self.staged, self.path):
            key = _read_key(candidate)
            if key is not None and key.key_id == key_id:
                return key
        return None

    def find_retired(self, key_id: str) -> MasterKey | None:
        for raw in _read_retired(self.retired):
            key = MasterKey(raw)
            if key.key_id == key_id:
                return key
        return None

    def staged_key_id(self) -> str | None:
        key = _read_key(self.staged)
        return None if key is None else key.key_id

    def current_key_id(self) -> str | None:
        key = _read_key(self.path)
        return None if key is None else key.key_id

    def current(self) -> MasterKey:
        key = _read_key(self.path)
        if key is None:
            raise SealError(f"CRYPTD_MASTER_KEY_FILE {self.path} is missing or not a master key")
        return key

    def stage(self, key: bytes) -> None:
        atomic_write(self.staged, _encode(key), mode=0o600)

    def promote(self) -> None:
        """Retire the current key, then make the staged one current. Repeatable: a promotion
        cut short is finished by running it again."""
        current = self.path.read_text().strip()
        raw = decode_master_key(current, str(self.path))
        kept = _read_retired(self.retired)
        if raw not in kept:
            atomic_write(self.retired, b"".join(_encode(k) for k in [*kept, raw]), mode=0o600)
        os.replace(self.staged, self.path)
        _fsync_directory(self.path.parent)

    def discard_staged(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.staged.unlink()
            _fsync_directory(self.path.parent)


_KEY_ID = re.compile(r"[0-9a-f]{16}")


class SealedKeyFiles:
    """The pkcs11 (or transit) seal's sealed master key files: current, staged, and one retired
    file per old key (``<file>.retired-<key id>``), each opened by the token (Transit) key."""

    def __init__(self, seal: Pkcs11Seal | TransitSeal) -> None:
        self.seal = seal
        self.path = seal.sealed_file
        self.staged = staged_path(self.path)
        self.retired = retired_path(self.path)

    def _key_id(self, path: Path) -> str | None:
        try:
            return sealedfile.read(path).key_id
        except SealError:
            return None

    def staged_key_id(self) -> str | None:
        return self._key_id(self.staged)

    def current_key_id(self) -> str | None:
        return self._key_id(self.path)

    def _open(self, path: Path, key_id: str) -> MasterKey | None:
        if self._key_id(path) != key_id:
            return None  # the public id says it is not the one: the token is not asked
        try:
            return MasterKey(self.seal.open_sealed(path))
        except SealError:
            return None

    def find(self, key_id: str) -> MasterKey | None:
        for candidate in (self.staged, self.path):  # staged first, as StaticKeyFiles
            key = self._open(candidate, key_id)
            if key is not None:
                return key
        return None

    def find_retired(self, key_id: str) -> MasterKey | None:
        if not _KEY_ID.fullmatch(key_id):  # it comes from a backup's header
            return None
        return self._open(self.path.with_name(f"{self.retired.name}-{key_id}"), key_id)

    def current(self) -> MasterKey:
        return MasterKey(self.seal.unseal())

    def stage(self, key: bytes) -> None:
        sealedfile.write(self.staged, self.seal.seal_master(key), replace=True)
        self.staged.chmod(0o600)

    def promote(self) -> None:
        key_id = self.current_key_id()
        if key_id is None:
            raise SealError(f"{self.path} is not a sealed master key")
        keep = self.path.with_name(f"{self.retired.name}-{key_id}")
        if not keep.exists():
            atomic_write(keep, self.path.read_bytes(), mode=0o600)
        os.replace(self.staged, self.path)
        _fsync_directory(self.path.parent)

    def discard_staged(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.staged.unlink()
            _fsync_directory(self.path.parent)


KeyFiles: TypeAlias = "StaticKeyFiles | SealedKeyFiles | ShamirKeyFiles"


def _encode(key: bytes) -> bytes:
    return base64.b64encode(key) + b"\n"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shamir_files(settings: SealSettings, seal: Seal | None) -> ShamirKeyFiles:
    from service.seal.shamir_rotation import ShamirKeyFiles

    # An unsealed seal gives this process's key; without one, only the spec is wanted.
    known = seal.unseal() if seal is not None and seal.kind == "shamir" else None
    return ShamirKeyFiles(settings.sealed_master_key_path(), known)


def files_for(settings: SealSettings, seal: Seal | None = None) -> KeyFiles | None:
    """Where the seal keeps master keys for a rotation: the static seal's key file, the pkcs11
    seal's sealed file (opened by ``seal`` when given, this process's session, else by a seal
    of its own); None where there is nothing to look up."""
    if settings.seal == "pkcs11":
        from service.seal.pkcs11 import Pkcs11Seal

        if not isinstance(seal, Pkcs11Seal):
            seal = Pkcs11Seal.from_settings(settings)
        return SealedKeyFiles(seal)
    if settings.seal == "transit":
        from service.seal.transit import TransitSeal

        if not isinstance(seal, TransitSeal):
            seal = TransitSeal.from_settings(settings)
        return SealedKeyFiles(seal)
    if settings.seal == "shamir":
        return _shamir_files(settings, seal)
    if settings.seal != "static" or settings.master_key is not None:
        return None
    if settings.master_key_file is None:
        return None
    return StaticKeyFiles(settings.master_key_file)


def files_spec(files: KeyFiles | None) -> tuple[str, ...] | None:
    """``files`` as plain strings, for a pool process to build its own (and, for pkcs11, log
    in to the token itself: a session never crosses a fork)."""
    if isinstance(files, StaticKeyFiles):
        return ("static", str(files.path))
    if isinstance(files, SealedKeyFiles):
        seal = files.seal
        if seal.kind == "transit":
            return cast("TransitSeal", seal).spec()
        seal = cast("Pkcs11Seal", seal)
        return (
            "pkcs11",
            str(seal.module),
            seal.token_label,
            seal.key_label,
            str(seal.pin_file),
            str(seal.sealed_file),
        )
    if files is not None:
        return ("shamir", str(files.path))
    return None


def files_from_spec(spec: tuple[str, ...] | None, master: bytes | None = None) -> KeyFiles | None:
    """``master``: the key the process starts with (a Shamir hand-over is opened with it)."""
    if spec is None:
        return None
    if spec[0] == "transit":
        from service.seal.transit import TransitSeal

        return SealedKeyFiles(TransitSeal.from_spec(spec))
    if spec[0] == "shamir":
        from service.seal.shamir_rotation import ShamirKeyFiles

        return ShamirKeyFiles(Path(spec[1]), master)
    if spec[0] == "pkcs11":
        from service.seal.pkcs11 import Pkcs11Seal

        module, token, label, pin, sealed = spec[1:]
        return SealedKeyFiles(Pkcs11Seal(Path(module), token, label, Path(pin), Path(sealed)))
    return StaticKeyFiles(Path(spec[1]))


def settle(files: KeyFiles, store_key_id: str) -> str | None:
    """Finish or undo a rotation a SIGKILL interrupted, given the master key id the store
    names; the caller holds the rotation lock. Returns what was done (None: nothing)."""
    if not files.staged.exists():
        return None
    if files.staged_key_id() == store_key_id:
        files.promote()
        return "finished"
    if files.current_key_id() == store_key_id:
        files.discard_staged()  # the store never used it (or it is damaged)
        return "rolled back"
    raise SealError(
        f"the key store is under master key {store_key_id!r}, neither {files.path} nor "
        f"{files.staged} holds it: restore the right master key file"
    )


def settle_store(settings: SealSettings, store: KeyStore, seal: Seal | None = None) -> str | None:
    """At a start: settle an interrupted rotation unless one is running now."""
    files = files_for(settings, seal)
    expired = getattr(files, "drop_expired_handover", None)
    if files is None or not (files.staged.exists() or expired is not None):
        return None
    with store.try_lock(LOCK) as held:
        if not held:
            return None  # a rotation is running: it finishes its own work
        if expired is not None:
            expired()  # shamir: the old shares no longer lead to the current key
            if not files.staged.exists():
                return None
        raw = store.read()
        key_id = raw.get("master_key_id") if raw is not None else None
        if not isinstance(key_id, str):
            return None
        return settle(files, key_id)


def _settle_after_failure(files: KeyFiles, store: KeyStore) -> None:
    """The rewrite failed: undo the staged key if the store still names the old one (or
    promote it if the commit did land); if the store cannot be read, leave it for the next
    start or rotation to settle."""
    try:
        raw = store.read()
        key_id = raw.get("master_key_id") if raw is not None else None
        if isinstance(key_id, str):
            settle(files, key_id)
    except Exception as exc:  # the original error is the one to report
        log.warning(
            "staged master key left for the next start to settle",
            extra={"reason": type(exc).__name__},
        )


@dataclass(frozen=True)
class RotationReport:
    seal: str
    previous_master_key_id: str
    master_key_id: str
    keys: int
    versions: int
    generation: int
    seconds: float
    recovered: str | None

    def body(self) -> dict[str, object]:
        return {
            "seal": self.seal,
            "previous_master_key_id": self.previous_master_key_id,
            "master_key_id": self.master_key_id,
            "keys": self.keys,
            "versions": self.versions,
            "generation": self.generation,
            "seconds": round(self.seconds, 3),
            **({} if self.recovered is None else {"interrupted_rotation": self.recovered}),
        }


def refuse_unless_file(settings: SealSettings, seal: Seal | None = None) -> KeyFiles:
    """Where the new key goes; SealError saying why a rotation cannot run here."""
    if settings.seal in ("pkcs11", "transit"):
        files = files_for(settings, seal)
        assert files is not None
        return files
    if settings.seal == "shamir":
        return _shamir_files(settings, seal)
    if settings.seal != "static":
        raise SealError(
            f"CRYPTD_SEAL={settings.seal}: master-key rotation is supported for the static, "
            "pkcs11, transit and shamir seals (docs/DEPLOY.md, Rotating the master key)"
        )
    if settings.master_key is not None:
        raise SealError(
            "the master key is in CRYPTD_MASTER_KEY: a rotation has nowhere to keep the new "
            "key that every worker and restart would read. Move the key to a file "
            "(CRYPTD_MASTER_KEY_FILE, mode 0600), restart, then rotate"
        )
    static = files_for(settings)
    if static is None:
        raise SealError("CRYPTD_SEAL=static: set CRYPTD_MASTER_KEY_FILE")
    return static


def rotate(
    settings: SealSettings,
    snapshot: Snapshot,
    seal: Seal | None = None,
    files: KeyFiles | None = None,
) -> RotationReport:
    """Rotate the master key of the store ``snapshot`` serves (see the module docstring);
    ``files``: where the seal keeps keys, when the caller has them already."""
    files = files or refuse_unless_file(settings, seal)
    started = time.monotonic()
    with snapshot.store.try_lock(LOCK) as held:
        if not held:
            raise Conflict("a master-key rotation is already running")
        raw = snapshot.store.read()
        stored_id = raw.get("master_key_id") if raw is not None else None
        recovered = settle(files, stored_id) if isinstance(stored_id, str) else None
        previous = snapshot.master.key_id if stored_id is None else str(stored_id)
        if snapshot.read_only:
            raise Conflict("the keyring is read-only on this instance; rotate with the CLI")
        fresh = secrets.token_bytes(32)
        new = MasterKey(fresh)
        files.stage(fresh)
        try:
            keyring = snapshot.rotate_master(new)
        except BaseException:
            _settle_after_failure(files, snapshot.store)
            raise
        files.promote()
    versions = sum(len(k.versions) for k in (*keyring.values(), *keyring.internal.values()))
    return RotationReport(
        seal=settings.seal,
        previous_master_key_id=previous,
        master_key_id=new.key_id,
        keys=len(keyring) + len(keyring.internal),
        versions=versions,
        generation=keyring.generation,
        seconds=time.monotonic() - started,
        recovered=recovered,
    )
