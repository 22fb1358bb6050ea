"""Seal migration: the same master key kept by another seal (``cryptd operator seal-migrate``).

No key version is rewrapped: the key store stays as it is, byte for byte; only where the master
key is kept changes. The steps make a SIGKILL at any moment leave the old seal or the new one
working:

1. the master key is taken from the old seal and checked against the key store (it must open
   the keyring), under the store's master-key-rotation lock so no rotation runs meanwhile;
2. the new seal's file is written complete and atomically where it does not replace the old
   seal's, and opened again under the new seal before anything else happens;
3. when both seals use the same file (pkcs11, transit and shamir default to
   ``sealed-master-key.json``), the old one is first copied to ``<file>.from-<old seal>``, then
   the new one (written as ``<file>.migrating``) is renamed over it: before the rename the old
   seal opens it, after it the new one does.

Run again after an interruption, it finishes what is left or reports that the new seal
already holds the key. The old seal's own file is never deleted here: the operator removes
it once every replica runs with the new seal (docs/DEPLOY.md, Moving to another seal).
"""

from __future__ import annotations

import base64
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from service.config import SealSettings, decode_master_key
from service.fileio import atomic_write
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeyStore
from service.seal import sealedfile, unseal_once
from service.seal.base import SealError
from service.seal.rotation import LOCK, staged_path

if TYPE_CHECKING:
    from service.seal.pkcs11 import Pkcs11Seal  # the binding is an optional extra
    from service.seal.transit import TransitSeal

SEALS = ("static", "pkcs11", "transit", "shamir")
PLAIN_WARNING = (
    "the master key is now in a plain file again: whoever reads it holds every key. Keep it "
    "mode 0600 on an encrypted volume, and prefer a sealed seal in production"
)


@dataclass
class MigrationReport:
    source: str
    target: str
    master_key_id: str
    written: Path
    previous: Path | None  # the old seal's file (kept), None: CRYPTD_MASTER_KEY
    backup: Path | None = None  # the old seal's file copied aside (same file for both)
    already: bool = False  # run again after an interruption: the new seal held the key
    shares: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def body(self) -> dict[str, object]:
        body: dict[str, object] = {
            "from": self.source,
            "to": self.target,
            "master_key_id": self.master_key_id,
            "written": str(self.written),
            "previous": None if self.previous is None else str(self.previous),
        }
        if self.backup is not None:
            body["previous_copied_to"] = str(self.backup)
        if self.already:
            body["already_migrated"] = True
        return body


def artifact(settings: SealSettings) -> Path | None:
    """The file a seal keeps the master key in (or its shares' public facts)."""
    if settings.seal == "static":
        return settings.master_key_file
    return settings.sealed_master_key_path()


def target_settings(
    source: SealSettings, to: str, *, master_key_file: Path | None, sealed_file: Path | None
) -> SealSettings:
    """The new seal's settings: the environment's (CRYPTD_PKCS11_*, CRYPTD_TRANSIT_*), the
    master key never in them unless ``to`` is static."""
    if to not in SEALS:
        raise SealError(f"--to {to}: one of {', '.join(SEALS)}")
    if to == source.seal:
        raise SealError(
            f"the deployment already uses CRYPTD_SEAL={to}: nothing to migrate (a new master key "
            "under the same seal is `cryptd operator rotate-master-key`)"
        )
    if to == "static":
        if master_key_file is None:
            raise SealError("--to static needs --master-key-file PATH (where the key goes)")
        return SealSettings(
            seal="static", master_key=None, master_key_file=master_key_file,
            sealed_master_key_file=None, keyring_file=source.keyring_file,
        )  # fmt: skip
    if master_key_file is not None:
        raise SealError("--master-key-file is where --to static writes the key; not for --to " + to)
    return SealSettings(
        seal=to,  # type: ignore[arg-type]  # checked against SEALS above
        master_key=None,
        master_key_file=None,
        sealed_master_key_file=sealed_file or source.sealed_master_key_path(),
        keyring_file=source.keyring_file,
    )


def _holds(target: SealSettings, path: Path, key_id: str | None = None) -> str | None:
    """The key id ``path`` holds under the new seal (opened, for pkcs11 and transit), None
    when it holds none of the new seal."""
    if not path.exists():
        return None
    try:
        if target.seal == "static":
            return MasterKey(decode_master_key(path.read_text(), str(path))).key_id
        if target.seal == "shamir":
            from service.seal.shamir import read_split

            return read_split(path).key_id
        sealed = sealedfile.read(path)
        if sealed.seal != target.seal or (key_id is not None and sealed.key_id != key_id):
            return None
        seal = _sealing(target, path)
        try:
            return MasterKey(seal.open_sealed(path)).key_id
        finally:
            seal.close()
    except (SealError, ValueError, OSError):
        return None


def _sealing(target: SealSettings, path: Path) -> Pkcs11Seal | TransitSeal:
    if target.seal == "pkcs11":
        from service.seal.pkcs11 import Pkcs11Seal

        seal = Pkcs11Seal.from_settings(target)
        seal.sealed_file = path
        return seal
    from service.seal.transit import TransitSeal

    return TransitSeal(target, path)


def _write(
    target: SealSettings, path: Path, master: bytes, shares: tuple[int, int] | None
) -> list[str]:
    """The new seal's file at ``path`` (which does not exist), complete or absent."""
    if target.seal == "static":
        atomic_write(path, base64.b64encode(master) + b"\n", mode=0o600)
        return []
    if target.seal == "shamir":
        from shamir_mnemonic import combine_mnemonics

        from service.seal.shamir import split

        if shares is None:
            raise SealError("--to shamir needs --shares N --threshold K")
        mnemonics = split(path, shares[0], shares[1], master)
        # The shares are shown once: prove they rebuild the key before anyone relies on them.
        if not secrets.compare_digest(bytes(combine_mnemonics(mnemonics[: shares[1]])), master):
            path.unlink()
            raise SealError("the new shares do not rebuild the master key; nothing changed")
        return mnemonics
    seal = _sealing(target, path)
    try:
        seal.init(master)
    finally:
        seal.close()
    return []


def _check_store(store: KeyStore, master: bytes) -> None:
    manager = KeyManager(store, MasterKey(master), read_only=True)
    manager.load()  # refuses a master key that does not open this keyring


def migrate(
    source: SealSettings,
    target: SealSettings,
    store: KeyStore,
    *,
    shares: tuple[int, int] | None = None,
) -> MigrationReport:
    """Move the master key from the ``source`` seal to the ``target`` seal (module docstring)."""
    if shares is not None and target.seal != "shamir":
        raise SealError("--shares and --threshold split the key for --to shamir only")
    old_file = artifact(source)
    new_file = artifact(target)
    assert new_file is not None  # target_settings gives every seal its file
    same = old_file is not None and old_file.resolve() == new_file.resolve()
    with store.try_lock(LOCK) as held:
        if not held:
            raise SealError("a master-key rotation is running: migrate the seal after it ends")
        if old_file is not None and staged_path(old_file).exists():
            raise SealError(
                f"{staged_path(old_file)} exists: a master-key rotation was interrupted; start "
                "the service once (or run rotate-master-key) to settle it, then migrate"
            )
        raw = store.read()
        store_key_id = raw.get("master_key_id") if raw is not None else None
        done = _holds(target, new_file, store_key_id if isinstance(store_key_id, str) else None)
        if done is not None and done == store_key_id:
            # An earlier run got this far (a SIGKILL after the new file was complete).
            return MigrationReport(
                source.seal, target.seal, done, new_file, old_file,
                backup=_backup_path(new_file, source.seal) if same else None, already=True,
            )  # fmt: skip
        if not same and new_file.exists():
            raise SealError(
                f"{new_file} exists and is not this deployment's master key under "
                f"CRYPTD_SEAL={target.seal}: move it away, or give another path"
            )
        master = unseal_once(source)
        _check_store(store, master)
        key_id = MasterKey(master).key_id
        written = new_file.with_name(new_file.name + ".migrating") if same else new_file
        if same and written.exists():
            written.unlink()  # left by an interrupted run, never used by anything
        mnemonics = _write(target, written, master, shares)
        if target.seal != "shamir" and _holds(target, written, key_id) != key_id:
            written.unlink()
            raise SealError(
                f"the new {target.seal} seal does not open what it wrote; nothing changed"
            )
        report = MigrationReport(source.seal, target.seal, key_id, new_file, old_file)
        report.shares = mnemonics
        if same:
            assert old_file is not None
            report.backup = _backup_path(new_file, source.seal)
            atomic_write(report.backup, old_file.read_bytes(), mode=0o600)
            os.replace(written, new_file)
            _fsync_directory(new_file.parent)
    if target.seal == "static":
        report.warnings.append(PLAIN_WARNING)
    return report


def _backup_path(path: Path, seal: str) -> Path:
    return path.with_name(f"{path.name}.from-{seal}")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
