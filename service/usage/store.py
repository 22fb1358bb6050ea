"""The usage-store interface: counters per (key, version, operation) that many processes add to.

A row is identified by the key's name, the key's ``created_at`` (so a key deleted and created
again under the same name starts from zero), its version and the operation. ``add`` applies
one flush: every row's count grows by its increment and its ``last_used_at`` becomes the later
of the two, in one transaction. Backends, one module each:

- :mod:`service.usage.sqlite`: with the keyring file, a SQLite database beside it
  (``CRYPTD_USAGE_FILE``), which every server worker of the host opens;
- :mod:`service.usage.postgres`: with the PostgreSQL key store, a table in the same database,
  shared by every replica.

:func:`service.stores.open_usage_store` picks one; this interface imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

# (key name, key created_at, version, operation)
UsageKey = tuple[str, str, int, str]
# increment, seconds since the epoch of the latest use it covers
Increment = tuple[int, float]

# The operations counted: the API's, with rewrap counted on both keys it touches.
OPERATIONS: tuple[str, ...] = (
    "encrypt",
    "decrypt",
    "sign",
    "verify",
    "hmac",
    "datakey",
    "rewrap_from",
    "rewrap_to",
    "encapsulate",
    "decapsulate",
)


class UsageUnavailable(Exception):
    """The usage store cannot be read or written now. The message names the place and the
    cause, never credentials."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    key: str
    key_created: str
    version: int
    operation: str
    count: int
    last_used_at: float  # seconds since the epoch


class UsageStore(Protocol):
    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""

    @property
    def description(self) -> str:
        """Where the counters live, for logs (never a password)."""

    def add(self, increments: Mapping[UsageKey, Increment]) -> None:
        """Add every increment in one transaction (all or nothing)."""

    def read(self, key: str, key_created: str) -> list[UsageRow]:
        """Every row of one key."""

    def read_all(self) -> list[UsageRow]:
        """Every row (``cryptd keys usage``)."""

    def close(self) -> None: ...


def ordered(increments: Mapping[UsageKey, Increment]) -> list[tuple[UsageKey, Increment]]:
    """Rows in primary-key order: concurrent writers then lock rows in one order (no
    deadlock between two replicas flushing the same keys)."""
    return sorted(increments.items())
