"""Opening the stores the settings name: the one place that knows every backend.

The interfaces (:mod:`service.keys.store`, :mod:`service.usage.store`) name no backend, and
each backend imports only its interface; the application's wiring (``create_app``, the CLI,
the pool's initializer) opens stores here. A new backend is one module and one branch below.
"""

from __future__ import annotations

from pathlib import Path

from service.keys.store import KeyStore
from service.usage.store import UsageStore


def open_store(url: str | None, keyring_file: Path) -> KeyStore:
    """PostgreSQL when ``url`` is given (``postgresql://...``), else the keyring file."""
    if url:
        from service.keys.pgstore import PostgresKeyStore  # the driver is an optional extra

        return PostgresKeyStore(url)
    from service.keys.filestore import FileKeyStore

    return FileKeyStore(keyring_file)


def open_usage_store(keystore_url: str | None, usage_file: Path) -> UsageStore:
    """The PostgreSQL table when the keys live in PostgreSQL, else the SQLite file."""
    if keystore_url:
        from service.usage.postgres import PostgresUsageStore

        return PostgresUsageStore(keystore_url)
    from service.usage.sqlite import SqliteUsageStore

    return SqliteUsageStore(usage_file)
