"""The Transit seal (auto-unseal): the master key exists at rest only as ciphertext of a key
held by another service, an OpenBao or Vault Transit engine or another cryptd, which decrypts
it for each starting process.

The sealed master key file (service/seal/sealedfile.py) holds the Transit ciphertext, made with
associated data that names this seal and key, so a ciphertext of another key, mount or seal is
refused by the Transit engine itself; the decrypted key must also carry the stored fingerprint.
Each process (every server worker, each CLI run) asks the Transit service itself. Once
unsealed, the master key is in memory: a Transit service that goes away later only degrades
the service (``status``), and what needs the seal again (a master-key rotation, a seal
migration) is refused with 503 until it is back.

OpenBao and Vault: ``CRYPTD_TRANSIT_ADDRESS``, ``CRYPTD_TRANSIT_TOKEN_FILE`` (a token whose
policy allows ``update`` on ``<mount>/encrypt/<key>`` and ``<mount>/decrypt/<key>``),
``CRYPTD_TRANSIT_MOUNT`` (default ``transit``), ``CRYPTD_TRANSIT_KEY`` (an ``aes256-gcm96``
key, default ``cryptd-seal``). Another cryptd: ``CRYPTD_TRANSIT_CREDENTIAL_FILE`` (a client
credential file as ``cryptd clients add`` writes it, allowed encrypt and decrypt on the key)
and ``CRYPTD_TRANSIT_KEY`` (an ``aes256-gcm`` key of that cryptd); the address is the
credential's unless ``CRYPTD_TRANSIT_ADDRESS`` overrides it. ``CRYPTD_TRANSIT_CA_FILE``: the
CA that signed the Transit service's certificate.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import secrets
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from service.config import SealSettings
from service.keys.masterkey import MasterKey
from service.seal import sealedfile
from service.seal.base import SealError, SealStatus

STATUS_CACHE_SECONDS = 2.0  # /readyz is unsigned: it must not let anyone drive Transit calls
PROBE_TIMEOUT = 1.0  # a readiness probe (k8s: timeoutSeconds 2) must not wait on a dead peer
PROBE = b"cryptd transit seal probe"
PROBE_AAD = b"cryptd-transit-probe"
SPEC_FIELDS = {
    "seal",
    "transit_address",
    "transit_key",
    "transit_mount",
    "transit_token_file",
    "transit_credential_file",
    "transit_ca_file",
    "transit_timeout",
}


class TransitUnavailable(SealError):
    """The Transit service cannot be reached or answers with a server error: a retry may cure
    it (503 with Retry-After), nothing was changed."""


@dataclass(frozen=True)
class InitReport:
    sealed_file: Path
    key_id: str
    key_version: int | None


class Backend(Protocol):
    label: str  # names the key in the sealed file and its associated data
    address: str

    def encrypt(self, plaintext: bytes, aad: bytes) -> str: ...

    def decrypt(self, ciphertext: str, aad: bytes) -> bytes: ...

    def rotate_key(self) -> None: ...

    def close(self) -> None: ...


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _verify(ca_file: Path | None) -> ssl.SSLContext | bool:
    if ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError):
        raise SealError(f"CRYPTD_TRANSIT_CA_FILE {ca_file} cannot be read as a CA") from None


class OpenBaoTransit:
    """The Transit secrets engine of OpenBao or Vault, over its HTTP API."""

    def __init__(
        self,
        address: str,
        mount: str,
        key: str,
        token_file: Path,
        ca_file: Path | None = None,
        timeout: float = 5.0,
    ) -> None:
        self.address = address.rstrip("/")
        self.mount = mount.strip("/")
        self.key = key
        self.token_file = token_file
        self.label = f"{self.mount}/{key}"
        self._http = httpx.Client(base_url=self.address, timeout=timeout, verify=_verify(ca_file))

    def _token(self) -> str:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise SealError(
                f"CRYPTD_TRANSIT_TOKEN_FILE {self.token_file} cannot be read ({exc.strerror})"
            ) from None
        if not token:
            raise SealError(f"CRYPTD_TRANSIT_TOKEN_FILE {self.token_file} is empty")
        return token

    def _post(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        path = f"/v1/{self.mount}/{operation}/{self.key}"
        headers = {"X-Vault-Token": self._token(), "X-Vault-Request": "true"}
        try:
            answer = self._http.post(path, content=orjson.dumps(body), headers=headers)
        except httpx.HTTPError as exc:
            raise TransitUnavailable(
                f"the Transit service at {self.address} cannot be reached "
                f"({type(exc).__name__}): check CRYPTD_TRANSIT_ADDRESS and that it is up"
            ) from None
        if answer.status_code in (200, 204):
            data = orjson.loads(answer.content) if answer.content else {}
            return dict(data.get("data") or {})
        raise self._refusal(operation, answer)

    def _refusal(self, operation: str, answer: httpx.Response) -> SealError:
        try:
            errors = " ".join(str(e) for e in orjson.loads(answer.content).get("errors", []))
        except (orjson.JSONDecodeError, AttributeError):
            errors = ""
        where = f"{self.address}/v1/{self.mount}/{operation}/{self.key}"
        if answer.status_code == 403:
            return SealError(
                f"the Transit service refused the token in CRYPTD_TRANSIT_TOKEN_FILE for "
                f"{self.mount}/{operation}/{self.key} (permission denied: a wrong or expired "
                "token, or a policy without update on that path)"
            )
        if answer.status_code == 404:
            return SealError(
                f"{where} does not exist: check CRYPTD_TRANSIT_MOUNT (is the Transit engine "
                "enabled there?)"
            )
        if "key not found" in errors or "no existing key" in errors:
            return SealError(
                f"no Transit key {self.key!r} on mount {self.mount!r} at {self.address}: "
                "check CRYPTD_TRANSIT_KEY and CRYPTD_TRANSIT_MOUNT"
            )
        if answer.status_code >= 500 or answer.status_code == 429:
            # 503: the Transit server is itself sealed or on standby.
            return TransitUnavailable(
                f"the Transit service at {self.address} answered {answer.status_code}: it is "
                "sealed, overloaded or failing"
            )
        if operation == "decrypt":
            return SealError(
                f"Transit key {self.label!r} refused the wrapped master key: it was made with "
                "another key, or altered"
            )
        return SealError(f"the Transit service refused {operation} ({answer.status_code})")

    def encrypt(self, plaintext: bytes, aad: bytes) -> str:
        data = self._post("encrypt", {"plaintext": _b64(plaintext), "associated_data": _b64(aad)})
        ciphertext = data.get("ciphertext")
        if not isinstance(ciphertext, str):
            raise SealError("the Transit service answered encrypt without a ciphertext")
        return ciphertext

    def decrypt(self, ciphertext: str, aad: bytes) -> bytes:
        body = {"ciphertext": ciphertext, "associated_data": _b64(aad)}
        data = self._post("decrypt", body)
        try:
            return base64.b64decode(str(data.get("plaintext", "")), validate=True)
        except binascii.Error:
            raise SealError("the Transit service answered decrypt with no plaintext") from None

    def rotate_key(self) -> None:
        path = f"/v1/{self.mount}/keys/{self.key}/rotate"
        headers = {"X-Vault-Token": self._token()}
        try:
            answer = self._http.post(path, content=b"{}", headers=headers)
        except httpx.HTTPError as exc:
            raise TransitUnavailable(
                f"the Transit service at {self.address} cannot be reached ({type(exc).__name__})"
            ) from None
        if answer.status_code not in (200, 204):
            raise self._refusal("keys", answer)

    def close(self) -> None:
        self._http.close()


class CryptdTransit:
    """Another cryptd's ``aes256-gcm`` key, through the signing Python client."""

    def __init__(
        self,
        credential_file: Path,
        key: str,
        address: str | None = None,
        ca_file: Path | None = None,
        timeout: float = 5.0,
    ) -> None:
        from cryptd_client import CryptdClient, CryptdConfigurationError

        self.key = key
        self.label = f"cryptd/{key}"
        options: dict[str, Any] = {"timeout": timeout, "retries": 0}
        if address:
            options["url"] = address
        if ca_file is not None:
            options["ca_file"] = ca_file
        try:
            self._client = CryptdClient.from_file(credential_file, **options)
        except (OSError, CryptdConfigurationError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise SealError(
                f"CRYPTD_TRANSIT_CREDENTIAL_FILE {credential_file} cannot be used ({reason})"
            ) from None
        self.address = self._client.url

    def _call(self, operation: str, call: Any) -> Any:
        from cryptd_client import (
            CryptdAPIError,
            CryptdConnectionError,
            DecryptionFailedError,
            ForbiddenError,
            KeyNotFoundError,
            UnauthenticatedError,
        )

        try:
            return call()
        except CryptdConnectionError as exc:
            raise TransitUnavailable(
                f"the cryptd Transit peer at {self.address} cannot be reached "
                f"({type(exc).__name__}): check CRYPTD_TRANSIT_ADDRESS and that it is up"
            ) from None
        except KeyNotFoundError:
            raise SealError(
                f"the cryptd Transit peer at {self.address} has no key {self.key!r}: check "
                "CRYPTD_TRANSIT_KEY"
            ) from None
        except (UnauthenticatedError, ForbiddenError):
            raise SealError(
                f"the cryptd Transit peer at {self.address} refused the client of "
                f"CRYPTD_TRANSIT_CREDENTIAL_FILE for {operation} on {self.key!r}"
            ) from None
        except DecryptionFailedError:
            raise SealError(
                f"Transit key {self.label!r} refused the wrapped master key: it was made with "
                "another key, or altered"
            ) from None
        except CryptdAPIError as exc:
            if exc.status >= 500 or exc.status == 429:
                raise TransitUnavailable(
                    f"the cryptd Transit peer at {self.address} answered {exc.status}"
                ) from None
            raise SealError(
                f"the cryptd Transit peer refused {operation} ({exc.status} {exc.code})"
            ) from None

    def encrypt(self, plaintext: bytes, aad: bytes) -> str:
        result = self._call("encrypt", lambda: self._client.encrypt(self.key, plaintext, aad=aad))
        return str(result.ciphertext)

    def decrypt(self, ciphertext: str, aad: bytes) -> bytes:
        result = self._call("decrypt", lambda: self._client.decrypt(self.key, ciphertext, aad=aad))
        return bytes(result.plaintext)

    def rotate_key(self) -> None:
        self._call("rotate", lambda: self._client.rotate_key(self.key))

    def close(self) -> None:
        self._client.close()


def backend_from_settings(settings: SealSettings, timeout: float | None = None) -> Backend:
    timeout = settings.transit_timeout if timeout is None else timeout
    if settings.transit_credential_file is not None:
        return CryptdTransit(
            settings.transit_credential_file,
            settings.transit_key,
            settings.transit_address,
            settings.transit_ca_file,
            timeout,
        )
    # SealSettings refuses CRYPTD_SEAL=transit without one of the two.
    assert settings.transit_address is not None
    assert settings.transit_token_file is not None
    return OpenBaoTransit(
        settings.transit_address,
        settings.transit_mount,
        settings.transit_key,
        settings.transit_token_file,
        settings.transit_ca_file,
        timeout,
    )


def _key_version(ciphertext: str) -> int | None:
    """The Transit key version a ciphertext was made with (``vault:v<N>:`` and
    ``cryptd:v<N>:`` alike)."""
    parts = ciphertext.split(":", 2)
    if len(parts) == 3 and parts[1].startswith("v") and parts[1][1:].isdigit():
        return int(parts[1][1:])
    return None


class TransitSeal:
    kind = "transit"

    def __init__(self, settings: SealSettings, sealed_file: Path | None = None) -> None:
        self.settings = settings
        self.sealed_file = sealed_file or settings.sealed_master_key_path()
        self._backend: Backend | None = None
        self._probe_backend: Backend | None = None
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._probe_ciphertext: str | None = None
        self._status: tuple[float, SealStatus] | None = None

    @classmethod
    def from_settings(cls, settings: SealSettings) -> TransitSeal:
        return cls(settings)

    def spec(self) -> tuple[str, ...]:
        """What a pool process needs to build its own (a connection never crosses a fork):
        the settings as JSON, never a token (only the token file's path)."""
        fields = self.settings.model_dump(mode="json", include=SPEC_FIELDS)
        return ("transit", orjson.dumps(fields).decode(), str(self.sealed_file))

    @classmethod
    def from_spec(cls, spec: tuple[str, ...]) -> TransitSeal:
        fields = orjson.loads(spec[1])
        for name in ("transit_token_file", "transit_credential_file", "transit_ca_file"):
            if fields.get(name) is not None:
                fields[name] = Path(fields[name])
        # Validated where it was made (the server's settings): taken as they are.
        return cls(SealSettings.model_construct(**fields), Path(spec[2]))

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = backend_from_settings(self.settings)
        return self._backend

    @property
    def key_label(self) -> str:
        return self.backend.label

    # -- the seal ---------------------------------------------------------------------------

    def unseal(self) -> bytes:
        master = self.open_sealed(self.sealed_file)
        # The key answers now: a probe ciphertext for status() (an encrypt refused by the
        # token's policy only leaves status() to decrypt the sealed file instead).
        with self._lock:
            if self._probe_ciphertext is None:
                with contextlib.suppress(SealError):
                    self._probe_ciphertext = self.backend.encrypt(PROBE, PROBE_AAD)
        return master

    def open_sealed(self, path: Path) -> bytes:
        """The master key sealed in ``path``, decrypted by the Transit key; SealError saying
        why not (TransitUnavailable: the Transit service is away)."""
        sealed = sealedfile.read(path)
        with self._lock:
            backend = self.backend
            if sealed.seal != self.kind or sealed.key_label != backend.label:
                raise SealError(
                    f"{path} was sealed by {sealed.seal} key {sealed.key_label!r}, not "
                    f"transit key {backend.label!r}"
                )
            try:
                ciphertext = sealed.ciphertext.decode("ascii")
            except UnicodeDecodeError:
                raise SealError(f"{path} is not a Transit-wrapped master key") from None
            master = backend.decrypt(ciphertext, sealed.associated_data())
        if len(master) != 32 or not secrets.compare_digest(MasterKey(master).key_id, sealed.key_id):
            raise SealError(f"the wrapped master key in {path} is not a master key")
        return master

    def seal_master(self, master: bytes) -> sealedfile.SealedKey:
        """``master`` encrypted by the Transit key's latest version. The key must still
        decrypt what this seal made with it: an OpenBao encrypt would create a deleted key
        anew, and the new master key must not go under a key nothing else knows."""
        self._check_key()
        with self._lock:
            backend = self.backend
            aad = sealedfile.associated_data(self.kind, backend.label)
            ciphertext = backend.encrypt(master, aad)
        return sealedfile.SealedKey(
            self.kind, backend.label, b"", ciphertext.encode("ascii"), MasterKey(master).key_id
        )

    def _check_key(self) -> None:
        if self._probe_ciphertext is not None:
            with self._lock:
                self.backend.decrypt(self._probe_ciphertext, PROBE_AAD)
        elif self.sealed_file.exists():
            self.open_sealed(self.sealed_file)

    def init(self, master: bytes | None = None) -> InitReport:
        """Wrap ``master`` (a fresh random key by default) with the Transit key into the
        sealed file, and check that it opens again. Refuses to replace an existing file."""
        sealedfile.refuse_existing(self.sealed_file)
        master = secrets.token_bytes(32) if master is None else master
        sealed = self.seal_master(master)
        ciphertext = sealed.ciphertext.decode("ascii")
        with self._lock:  # unwrapped once before it is kept: a key that cannot decrypt fails here
            opened = self.backend.decrypt(ciphertext, sealed.associated_data())
        if not secrets.compare_digest(opened, master):
            raise SealError("the Transit service did not give back the key it wrapped")
        sealedfile.write(self.sealed_file, sealed)
        return InitReport(self.sealed_file, sealed.key_id, _key_version(ciphertext))

    def rotate_key(self) -> None:
        """A new version of the Transit key (``--rotate-transit-key``): later wraps use it."""
        with self._lock:
            self.backend.rotate_key()

    def status(self) -> SealStatus:
        now = time.monotonic()
        cached = self._status
        if cached is not None and now - cached[0] < STATUS_CACHE_SECONDS:
            return cached[1]
        if not self._probe_lock.acquire(blocking=False):
            if cached is not None:
                return cached[1]  # a probe is under way: its answer comes soon
            self._probe_lock.acquire()
        try:
            reason = self._probe()
        finally:
            self._probe_lock.release()
        status = SealStatus(
            self.kind, sealed=False, threshold=1, progress=0, available=reason is None,
            reason=reason,
        )  # fmt: skip
        self._status = (now, status)
        return status

    def _probe(self) -> str | None:
        """None when the Transit key still decrypts for this seal, else why not. The probe
        decrypts the constant made at unseal, and never encrypts (an OpenBao encrypt may
        create a missing key); without one, the sealed file is opened again."""
        try:
            if self._probe_backend is None:
                self._probe_backend = backend_from_settings(
                    self.settings, min(PROBE_TIMEOUT, self.settings.transit_timeout)
                )
            backend = self._probe_backend
            if self._probe_ciphertext is None:
                sealed = sealedfile.read(self.sealed_file)
                opened = backend.decrypt(
                    sealed.ciphertext.decode("ascii"), sealed.associated_data()
                )
                ok = secrets.compare_digest(MasterKey(opened).key_id, sealed.key_id)
            else:
                ok = secrets.compare_digest(
                    backend.decrypt(self._probe_ciphertext, PROBE_AAD), PROBE
                )
            return None if ok else "Transit unavailable: the probe did not decrypt"
        except SealError as exc:
            return f"Transit unavailable: {exc.message}"
        except Exception as exc:  # never raises: readiness asks this
            return f"Transit unavailable: {type(exc).__name__}"

    def close(self) -> None:
        with self._lock, self._probe_lock:
            for backend in (self._backend, self._probe_backend):
                if backend is not None:
                    backend.close()
            self._backend = self._probe_backend = None
