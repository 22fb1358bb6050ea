"""What ``cryptd serve`` checks before any worker starts, and ``cryptd serve --check`` alone:
every problem of a configuration at once, each in a sentence saying what to set, and the
fields of the one start line that names what the server runs with."""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from service.auth.clients import ClientsFileError, load_registry
from service.config import Settings
from service.edge.tls import TLSFileError, TLSFiles, certificate_info, server_context
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeystoreError
from service.seal import SealError, open_seal, unseal_once
from service.seal.rotation import SealedKeyFiles, files_for
from service.stores import open_store

T = TypeVar("T")
A = TypeVar("A")


@dataclass
class Report:
    """``problems``: what stops the start, one sentence each; ``start``: the start line's
    fields (never a secret: URLs lose their credentials and query)."""

    problems: list[str] = field(default_factory=list)
    start: dict[str, object] = field(default_factory=dict)


def check(settings: Settings, *, reach_redis: bool = False) -> Report:
    """Check everything cheap to check without serving: the master key, the TLS files and
    certificate, the clients file, the key store (opened, keyring verified with the master
    key), the audit target, and with ``reach_redis`` a Redis ping. Nothing is written."""
    report = Report()
    start = report.start
    start.update(mode=settings.env, workers=settings.workers)
    master_key = _attempt(report, _master_key_problem, settings)
    start["seal"] = settings.seal
    start["master_key"] = _master_key_source(settings)
    _tls(settings, report)
    if settings.clients_file is not None:
        _attempt(report, _clients_problem, settings.clients_file)
    start["key_store"] = _key_store(settings, master_key, report)
    start["replay_store"] = _replay_store(settings, report, reach_redis)
    start["audit"] = settings.audit_log
    audit_problem = _audit_problem(settings.audit_log)
    if audit_problem:
        report.problems.append(audit_problem)
    start["access_log"] = settings.access_log
    start["metrics"] = settings.metrics
    return report


def _attempt(report: Report, action: Callable[[A], T], argument: A) -> T | None:
    """``action(argument)``; an error it raises (whose text names its setting) becomes a
    problem of the report."""
    try:
        return action(argument)
    except (ValueError, OSError, KeystoreError, ClientsFileError) as exc:
        report.problems.append(str(exc))
        return None


def _master_key_source(settings: Settings) -> str:
    if settings.seal == "pkcs11":
        return (
            f"sealed by token {settings.pkcs11_token_label!r} ({settings.sealed_master_key_path()})"
        )
    if settings.seal == "shamir":
        return f"Shamir shares (starts sealed; {settings.sealed_master_key_path()})"
    if settings.seal == "transit":
        where = settings.transit_address or f"the peer of {settings.transit_credential_file}"
        return (
            f"wrapped by Transit key {settings.transit_key!r} at {where} "
            f"({settings.sealed_master_key_path()})"
        )
    if settings.master_key is not None:
        return "CRYPTD_MASTER_KEY (environment)"
    return f"CRYPTD_MASTER_KEY_FILE {settings.master_key_file}"


def _master_key_problem(settings: Settings) -> bytes | None:
    """The master key as each worker will get it from the seal (pkcs11: the token, transit: the
    Transit service asked once here); ``None`` for a Shamir seal, whose key only the
    operators' shares give (its seal file is checked)."""
    try:
        if settings.seal == "shamir":
            open_seal(settings).close()
            return None
        if settings.seal in ("pkcs11", "transit"):
            return unseal_once(settings)  # transit: the service answers and opens the key
        return settings.load_master_key()
    except SealError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(
            f"CRYPTD_MASTER_KEY_FILE {settings.master_key_file}: {exc.strerror or exc}"
        ) from None


def _clients_problem(path: Path) -> None:
    try:
        load_registry(path)
    except ClientsFileError as exc:
        raise ValueError(f"CRYPTD_CLIENTS_FILE {exc}") from None


def _tls(settings: Settings, report: Report) -> None:
    cert_file, key_file = settings.tls_cert_file, settings.tls_key_file
    if cert_file is None or key_file is None:
        report.start["tls"] = "off"
        return
    client_ca = settings.tls_client_ca_file
    files = TLSFiles(cert_file, key_file, client_ca, settings.tls_client_cert)
    report.start["tls"] = "on" if client_ca is None else f"on, client certificates from {client_ca}"
    try:
        server_context(files)
        info = certificate_info(cert_file)
    except TLSFileError as exc:
        report.problems.append(str(exc))
        return
    report.start.update(tls_subject=info.subject, tls_not_after=info.not_after.isoformat())
    if info.expired():
        report.problems.append(
            f"CRYPTD_TLS_CERT_FILE {cert_file}: the certificate expired on "
            f"{info.not_after.isoformat()}; clients refuse it: install a renewed one"
        )


def _key_store(settings: Settings, master_key: bytes | None, report: Report) -> str:
    """Open the store and verify its keyring with the master key, as each worker will: a
    wrong master key, another deployment's store or an unreachable one is a problem here.
    Read only."""
    try:
        store = open_store(settings.keystore_url_value(), settings.keyring_file)
    except (ValueError, OSError, KeystoreError) as exc:
        report.problems.append(str(exc))  # names the store and says what to do
        return location(settings.keystore_url_value() or str(settings.keyring_file))
    try:
        if master_key is not None:
            files = files_for(settings)
            try:
                manager = KeyManager(
                    store,
                    MasterKey(master_key),
                    expected_deployment=settings.keystore_id,
                    lookup=files,  # a rotation a SIGKILL interrupted opens too
                )
                manager.load()
            finally:
                # As unseal_once: a PKCS#11 session of this check never outlives it.
                if isinstance(files, SealedKeyFiles):
                    files.seal.close()
        return store.description
    except (ValueError, OSError, KeystoreError) as exc:
        report.problems.append(str(exc))  # names the store and says what to do
        return store.description
    finally:
        store.close()


def _replay_store(settings: Settings, report: Report, reach_redis: bool) -> str:
    if settings.redis_url:
        where = location(settings.redis_url)
        if reach_redis:
            problem = _redis_problem(settings.redis_url)
            if problem:
                report.problems.append(f"CRYPTD_REDIS_URL {where}: {problem}")
        return f"redis {where}"
    if settings.replay_dir is not None:
        return f"host directory {settings.replay_dir}"
    return "memory (one worker)"


def _redis_problem(url: str) -> str | None:
    from service.auth.redis_client import close, connect

    async def ping() -> None:
        client = connect(url, socket_timeout=2.0)
        try:
            await client.ping()
        finally:
            await close(client)

    try:
        asyncio.run(ping())
    except Exception as exc:  # any failure to reach it: its type, never the URL it may quote
        return f"not reachable ({type(exc).__name__})"
    return None


def _audit_problem(target: str) -> str | None:
    if target in ("stderr", "off"):
        return None
    path = Path(target)
    if path.exists():
        writable = path.is_file() and os.access(path, os.W_OK)
    else:
        writable = os.access(path.parent, os.W_OK | os.X_OK)
    if not writable:
        return (
            f"CRYPTD_AUDIT_LOG {path}: cannot append to it (a file this user may write, in a "
            "directory that exists), or set CRYPTD_AUDIT_LOG=stderr"
        )
    return None


def location(url: str) -> str:
    """A store's URL without credentials or query (either may hold a password); a path as
    it is."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}"
