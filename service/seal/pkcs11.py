"""The PKCS#11 seal: the master key exists at rest only as AES-256-GCM ciphertext under a
non-extractable AES-256 key inside a token (an HSM, or SoftHSM2 in tests).

The token key never leaves the token: the master key is decrypted by the token itself and
held in this process's memory from then on. PKCS#11 state does not survive a fork, so each
process (every server worker, each CLI run) loads the module, logs in and opens a session of
its own. A token that goes away later only degrades the service: the master key is already in
memory, so crypto keeps serving while ``status`` reports the token unavailable.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, MechanismFlag, ObjectClass
from pkcs11.exceptions import (
    MultipleObjectsReturned,
    MultipleTokensReturned,
    NoSuchKey,
    NoSuchToken,
    PinIncorrect,
    PinLenRange,
    PKCS11Error,
    UserAlreadyLoggedIn,
)

from service.config import SealSettings
from service.keys.masterkey import MasterKey
from service.seal import sealedfile
from service.seal.base import SealError, SealStatus

NONCE_BYTES = 12
STATUS_CACHE_SECONDS = 1.0  # /readyz is unsigned: it must not let anyone load the token


@dataclass(frozen=True)
class InitReport:
    token_key_created: bool
    sealed_file: Path
    key_id: str


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__


class Pkcs11Seal:
    kind = "pkcs11"

    def __init__(
        self, module: Path, token_label: str, key_label: str, pin_file: Path, sealed_file: Path
    ) -> None:
        self.module = module
        self.token_label = token_label
        self.key_label = key_label
        self.pin_file = pin_file
        self.sealed_file = sealed_file
        self._lock = threading.Lock()
        self._lib: Any = None  # pkcs11.lib, a function in the stubs
        self._session: pkcs11.Session | None = None
        self._status: tuple[float, SealStatus] | None = None

    @classmethod
    def from_settings(cls, settings: SealSettings) -> Pkcs11Seal:
        # SealSettings refuses CRYPTD_SEAL=pkcs11 without these three.
        assert settings.pkcs11_module is not None
        assert settings.pkcs11_token_label is not None
        assert settings.pkcs11_pin_file is not None
        return cls(
            settings.pkcs11_module,
            settings.pkcs11_token_label,
            settings.pkcs11_key_label,
            settings.pkcs11_pin_file,
            settings.sealed_master_key_path(),
        )

    # -- sessions ---------------------------------------------------------------------------

    def _pin(self) -> str:
        try:
            pin = self.pin_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise SealError(
                f"CRYPTD_PKCS11_PIN_FILE {self.pin_file} cannot be read ({exc.strerror})"
            ) from None
        if not pin:
            raise SealError(f"CRYPTD_PKCS11_PIN_FILE {self.pin_file} is empty")
        return pin

    def _open(self, *, rw: bool = False) -> pkcs11.Session:
        """Log in to the token (once per process; a session of a parent is never reused)."""
        if self._session is not None and not rw:
            return self._session
        if self._lib is None:
            try:
                self._lib = library(self.module)
            except Exception as exc:  # the binding raises RuntimeError, OSError, PKCS11Error
                raise SealError(
                    f"CRYPTD_PKCS11_MODULE {self.module} cannot be loaded ({_error_name(exc)})"
                ) from None
        try:
            token = self._lib.get_token(token_label=self.token_label)
        except NoSuchToken:
            raise SealError(
                f"no PKCS#11 token labelled {self.token_label!r} in {self.module}: check that "
                "the token is present and CRYPTD_PKCS11_TOKEN_LABEL"
            ) from None
        except MultipleTokensReturned:
            raise SealError(
                f"several PKCS#11 tokens are labelled {self.token_label!r}: give each its own label"
            ) from None
        except PKCS11Error as exc:
            raise SealError(
                f"the PKCS#11 module cannot list its tokens ({_error_name(exc)}): check that "
                f"token {self.token_label!r} is present and reachable"
            ) from None
        try:
            session: pkcs11.Session = token.open(user_pin=self._pin(), rw=rw)
        except UserAlreadyLoggedIn:
            # Logins are per process, not per session: this process is already logged in.
            session = token.open(rw=rw)
        except (PinIncorrect, PinLenRange):
            raise SealError(
                f"the PIN in CRYPTD_PKCS11_PIN_FILE is wrong for token {self.token_label!r}"
            ) from None
        except PKCS11Error as exc:
            raise SealError(
                f"cannot log in to token {self.token_label!r} ({_error_name(exc)})"
            ) from None
        if not rw:
            self._session = session
        return session

    def _token_key(self, session: pkcs11.Session) -> Any:  # a SecretKey with its mixins
        try:
            return session.get_key(
                object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label=self.key_label
            )
        except NoSuchKey:
            raise SealError(
                f"token {self.token_label!r} holds no AES key labelled {self.key_label!r}: "
                "run `cryptd operator init`, or check CRYPTD_PKCS11_KEY_LABEL"
            ) from None
        except MultipleObjectsReturned:
            raise SealError(
                f"token {self.token_label!r} holds several keys labelled {self.key_label!r}"
            ) from None

    # -- the seal ---------------------------------------------------------------------------

    def unseal(self) -> bytes:
        return self.open_sealed(self.sealed_file)

    def open_sealed(self, path: Path) -> bytes:
        """The master key sealed in ``path`` (the sealed file, or one a rotation staged or
        retired beside it), opened by the token key; SealError saying why not."""
        sealed = sealedfile.read(path)
        if sealed.seal != self.kind or sealed.key_label != self.key_label:
            raise SealError(
                f"{path} was sealed by {sealed.seal} key {sealed.key_label!r}, not "
                f"pkcs11 key {self.key_label!r}"
            )
        with self._lock:
            key = self._token_key(self._open())
            try:
                master = bytes(
                    key.decrypt(
                        sealed.ciphertext,
                        mechanism=Mechanism.AES_GCM,
                        mechanism_param=pkcs11.GCMParams(sealed.nonce, sealed.associated_data()),
                    )
                )
            except PKCS11Error:
                raise SealError(
                    f"the wrapped master key in {path} does not open under token key "
                    f"{self.key_label!r}: it was made with another token key, or altered"
                ) from None
        if len(master) != 32 or not secrets.compare_digest(MasterKey(master).key_id, sealed.key_id):
            raise SealError(f"the wrapped master key in {path} is not a master key")
        return master

    def seal_master(self, master: bytes) -> sealedfile.SealedKey:
        """``master`` sealed by the existing token key (a rotation's new master key)."""
        with self._lock:
            key = self._token_key(self._open())
            nonce = secrets.token_bytes(NONCE_BYTES)
            aad = sealedfile.associated_data(self.kind, self.key_label)
            try:
                ciphertext = key.encrypt(
                    master,
                    mechanism=Mechanism.AES_GCM,
                    mechanism_param=pkcs11.GCMParams(nonce, aad),
                )
            except PKCS11Error as exc:
                raise SealError(
                    f"the token could not seal the master key ({_error_name(exc)})"
                ) from None
        return sealedfile.SealedKey(
            self.kind, self.key_label, nonce, bytes(ciphertext), MasterKey(master).key_id
        )

    def init(self, master: bytes | None = None) -> InitReport:
        """Create the token key when it is absent, then seal ``master`` (a fresh random key by
        default) into the sealed file. Refuses to replace an existing sealed file."""
        sealedfile.refuse_existing(self.sealed_file)
        master = secrets.token_bytes(32) if master is None else master
        with self._lock:
            session = self._open(rw=True)
            try:
                created = False
                try:
                    key = self._token_key(session)
                except SealError:
                    key = session.generate_key(
                        KeyType.AES,
                        256,
                        label=self.key_label,
                        store=True,
                        capabilities=MechanismFlag.ENCRYPT | MechanismFlag.DECRYPT,
                        # The key is usable inside the token only: never readable, never wrapped
                        # out, never made readable later (PKCS#11 forbids turning these back).
                        template={
                            Attribute.SENSITIVE: True,
                            Attribute.EXTRACTABLE: False,
                            Attribute.PRIVATE: True,
                        },
                    )
                    created = True
                if key[Attribute.EXTRACTABLE] or not key[Attribute.SENSITIVE]:
                    raise SealError(
                        f"token key {self.key_label!r} is extractable or not sensitive: a seal "
                        "key must never leave the token; give it a new CRYPTD_PKCS11_KEY_LABEL"
                    )
                nonce = secrets.token_bytes(NONCE_BYTES)
                aad = sealedfile.associated_data(self.kind, self.key_label)
                ciphertext = key.encrypt(
                    master,
                    mechanism=Mechanism.AES_GCM,
                    mechanism_param=pkcs11.GCMParams(nonce, aad),
                )
            except PKCS11Error as exc:
                raise SealError(
                    f"the token could not seal the master key ({_error_name(exc)})"
                ) from None
            finally:
                session.close()
        key_id = MasterKey(master).key_id
        sealedfile.write(
            self.sealed_file,
            sealedfile.SealedKey(self.kind, self.key_label, nonce, bytes(ciphertext), key_id),
        )
        return InitReport(created, self.sealed_file, key_id)

    def status(self) -> SealStatus:
        now = time.monotonic()
        cached = self._status
        if cached is not None and now - cached[0] < STATUS_CACHE_SECONDS:
            return cached[1]
        with self._lock:
            reason = self._probe()
        status = SealStatus(
            self.kind,
            sealed=False,
            threshold=1,
            progress=0,
            available=reason is None,
            reason=reason,
        )
        self._status = (now, status)
        return status

    def _probe(self) -> str | None:
        """None when the token still answers for the seal key, else why not. A session that
        broke (token pulled and put back) is replaced by a fresh login."""
        for attempt in range(2):
            try:
                self._token_key(self._open())
                return None
            except (SealError, PKCS11Error) as exc:
                reason = str(exc) if isinstance(exc, SealError) else _error_name(exc)
            self._drop_session()
            if attempt == 0 and self._lib is not None:
                with contextlib.suppress(PKCS11Error):
                    self._lib.reinitialize()  # rescans the slots: a token may be back
        return f"token unavailable: {reason}"

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(PKCS11Error):
                session.close()

    def close(self) -> None:
        with self._lock:
            self._drop_session()
            self._lib = None


# One loaded module per process: C_Initialize and C_Finalize act on the module's global state,
# so two handles in one process would finalize each other. Keyed by pid: a forked child must
# initialise the module itself (a parent's PKCS#11 state is undefined in a child).
_LIBRARIES: dict[tuple[int, str], Any] = {}


def library(module: Path) -> Any:
    """This process's handle on ``module``, loaded and initialised on first use."""
    key = (os.getpid(), str(module))
    lib = _LIBRARIES.get(key)
    if lib is None:
        lib = _LIBRARIES[key] = pkcs11.lib(str(module))
    elif not lib.initialized:
        lib.initialize()
    return lib


def reinitialize(module: Path) -> None:
    """Finalize and initialise ``module`` again (every session of this process ends): the
    module rescans its slots and rereads its configuration."""
    lib = _LIBRARIES.get((os.getpid(), str(module)))
    if lib is not None:
        lib.reinitialize()
