"""Owns the current keyring snapshot: loading, hot reload and key management.

Readers take ``manager.keyring`` (an immutable snapshot) and never lock. Mutations lock the file,
read it fresh (another process may have written it), change it, write it atomically and swap
in the new snapshot. A reload that fails keeps the previous snapshot and records the error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from service.crypto.registry import KEY_TYPES
from service.errors import Conflict, InvalidRequest, KeyNotFound, KeystoreUnavailable
from service.fileio import FileStamp, atomic_write, file_stamp
from service.keys.keyring import Key, Keyring, check_key_flags, check_key_name
from service.keys.masterkey import MasterKey, WrongMasterKey
from service.keys.store import (
    KeyRecord,
    KeyringDocument,
    KeyringFile,
    KeyringFileError,
    VersionRecord,
    generation_of,
    utc_now,
)

log = logging.getLogger("cryptd.keyring")


class KeyManager:
    def __init__(
        self,
        path: Path,
        master: MasterKey,
        *,
        read_only: bool = False,
        activation_delay: float = 0.0,
        on_reload: Callable[[bool], None] | None = None,
    ) -> None:
        self.file = KeyringFile(path)
        self._master = master
        self._read_only = read_only
        self._activation_delay = activation_delay
        self._on_reload = on_reload
        self._lock = threading.Lock()  # one mutation or reload at a time in this process
        self._stamp: FileStamp | None = None
        self._keyring: Keyring | None = None
        self.last_reload_error: str | None = None

    @property
    def keyring(self) -> Keyring:
        if self._keyring is None:
            raise RuntimeError("keyring not loaded")
        return self._keyring

    def load(self) -> Keyring:
        """Initial load; raises KeyringFileError so startup fails loudly."""
        with self._lock:
            self._stamp = file_stamp(self.file.path)
            self._keyring = self.file.load(self._master, self._activation_delay)
            return self._keyring

    def reload(self) -> bool:
        """Reload from the file, keeping the previous snapshot if the new file is bad."""
        with self._lock:
            self._stamp = file_stamp(self.file.path)
            try:
                document, generation = self.file.read()
                if self._keyring is not None and generation == self._keyring.generation:
                    self.last_reload_error = None
                    return True
                keyring = document.build(self._master, generation, self._activation_delay)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, KeyringFileError) else type(exc).__name__
                self.last_reload_error = reason
                log.error(
                    "keyring reload failed; keeping the previous keyring",
                    extra={"reason": reason},
                )
                if self._on_reload:
                    self._on_reload(False)
                return False
            self._keyring = keyring
            self.last_reload_error = None
            log.info(
                "keyring reloaded",
                extra={"generation": keyring.generation, "keys": len(keyring)},
            )
            if self._on_reload:
                self._on_reload(True)
            return True

    def reload_if_changed(self) -> bool:
        """Cheap check for the file watcher: one stat call when nothing changed."""
        if file_stamp(self.file.path) == self._stamp:
            return False
        self.reload()
        return True

    # Key management -----------------------------------------------------------------------

    def _mutate(self, change: Callable[[KeyringDocument], None]) -> Keyring:
        """Read the file under its lock, verify it fully, apply ``change``, build the new
        keyring and only then write it. A file that fails verification is never rewritten (its
        MAC would launder the damage); a write that fails leaves the file and the keyring in
        memory as they were. Both answer 503 ``keystore_unavailable``."""
        if self._read_only:
            raise Conflict("the keyring is read-only on this instance; manage keys with the CLI")
        with self._lock:
            try:
                with self.file.locked():
                    try:
                        data = self.file.path.read_bytes()
                    except OSError as exc:
                        raise _unavailable(
                            f"the keyring file cannot be read ({exc.strerror})"
                        ) from None
                    try:
                        document = KeyringDocument.from_bytes(data)
                        document.verify(self._master)
                    except KeyringFileError as exc:
                        raise _refused(str(exc)) from None
                    change(document)
                    data = document.to_bytes(self._master)
                    try:
                        keyring = document.build(
                            self._master, generation_of(data), self._activation_delay
                        )
                    except Exception as exc:
                        reason = (
                            str(exc)
                            if isinstance(exc, KeyringFileError | WrongMasterKey)
                            else type(exc).__name__
                        )
                        raise _refused(f"keyring does not load: {reason}") from None
                    try:
                        atomic_write(self.file.path, data)
                    except OSError as exc:
                        raise _unavailable(
                            f"the keyring file could not be written ({exc.strerror})"
                        ) from None
            except OSError as exc:  # the lock file
                raise _unavailable(f"the keyring lock cannot be taken ({exc.strerror})") from None
            self._keyring = keyring
            self._stamp = file_stamp(self.file.path)
            self.last_reload_error = None
            return self._keyring

    def _new_version(
        self, name: str, type_name: str, version: int, material: bytes | None
    ) -> VersionRecord:
        key_type = KEY_TYPES[type_name]
        if material is None:
            material = key_type.generate()
        wrapped = self._master.wrap(material, name=name, version=version, type_name=type_name)
        return VersionRecord(version=version, created_at=utc_now(), material=wrapped)

    def create(
        self,
        name: str,
        type_name: str,
        *,
        deletion_allowed: bool = False,
        material: bytes | None = None,
        derived: bool = False,
        convergent: bool = False,
    ) -> Key:
        """Create a key; ``material`` (already validated by the type's import) imports one."""
        check_key_name(name)
        if type_name not in KEY_TYPES:
            raise InvalidRequest(f"unknown key type {type_name!r}")
        check_key_flags(KEY_TYPES[type_name], derived=derived, convergent=convergent)

        def change(document: KeyringDocument) -> None:
            if name in document.keys:
                raise Conflict(f"key {name!r} already exists")
            document.keys[name] = KeyRecord(
                type=type_name,
                created_at=utc_now(),
                deletion_allowed=deletion_allowed,
                versions=[self._new_version(name, type_name, 1, material)],
                derived=derived,
                convergent=convergent,
            )

        return self._mutate(change)[name]

    def rotate(self, name: str, *, material: bytes | None = None) -> Key:
        check_key_name(name)

        def change(document: KeyringDocument) -> None:
            record = _record(document, name)
            version = len(record.versions) + 1
            record.versions.append(self._new_version(name, record.type, version, material))

        return self._mutate(change)[name]

    def update(
        self,
        name: str,
        *,
        min_decryption_version: int | None = None,
        deletion_allowed: bool | None = None,
    ) -> Key:
        check_key_name(name)
        if min_decryption_version is None and deletion_allowed is None:
            raise InvalidRequest(
                "nothing to change: send min_decryption_version or deletion_allowed"
            )

        def change(document: KeyringDocument) -> None:
            record = _record(document, name)
            if min_decryption_version is not None:
                latest = len(record.versions)
                if not 1 <= min_decryption_version <= latest:
                    raise InvalidRequest(f"min_decryption_version must be between 1 and {latest}")
                record.min_decryption_version = min_decryption_version
            if deletion_allowed is not None:
                record.deletion_allowed = deletion_allowed

        return self._mutate(change)[name]

    def delete(self, name: str) -> None:
        check_key_name(name)

        def change(document: KeyringDocument) -> None:
            if not _record(document, name).deletion_allowed:
                raise Conflict(f"key {name!r} does not allow deletion")
            del document.keys[name]

        self._mutate(change)


def _refused(reason: str) -> KeystoreUnavailable:
    log.error("key management refused: the keyring failed verification", extra={"reason": reason})
    return KeystoreUnavailable(
        f"the key store failed verification ({reason}); key management is refused and "
        "nothing was changed. Crypto keeps serving the keyring loaded before. Restore the "
        "keyring from a backup (or undo the edit), then retry."
    )


def _unavailable(reason: str) -> KeystoreUnavailable:
    log.error("key management refused: the key store is unavailable", extra={"reason": reason})
    return KeystoreUnavailable(
        f"{reason}; nothing was changed and the keyring in memory still serves. Free space or "
        "fix the file's permissions, then retry."
    )


def _record(document: KeyringDocument, name: str) -> KeyRecord:
    record = document.keys.get(name)
    if record is None:
        raise KeyNotFound(f"key {name!r} not found")
    return record


def create_keyring_file(path: Path, master: MasterKey) -> None:
    """Write an empty keyring (refuses to overwrite an existing file)."""
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    KeyringFile(path).write(KeyringDocument(master_key_id=master.key_id), master)
