"""Defaults and small types that the settings and the modules they configure share.

A leaf: it imports only the standard library, so :mod:`service.config` can name these without
loading the modules that use them (auth, the key manager, the pools).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

# How far ahead of the server's clock ``created`` may be. Small on purpose: a replay store that
# starts empty (a Redis restart) refuses requests created before its start plus this much, so
# this bounds what a restart costs (docs/AUTH.md, "Replay protection").
DEFAULT_MAX_SKEW: Final = 5

# How long DELETE may wait before the material is destroyed (AWS KMS: 7 to 30 days).
MAX_DELETION_WAITING_PERIOD = 366 * 86400

# Dual control (service/keys/approvals.py): the operations CRYPTD_APPROVALS may name, and the
# bounds of CRYPTD_APPROVAL_TTL (seconds from the request to the last moment to carry it out).
APPROVAL_OPERATIONS: Final = (
    "delete",
    "backup",
    "import",
    "restore",
    "enable",
    "rotate-master-key",
)
DEFAULT_APPROVAL_TTL: Final = 3600
MIN_APPROVAL_TTL: Final = 60
MAX_APPROVAL_TTL: Final = 7 * 86400

# Where work runs (service/pool/).
ExecutorKind = Literal["inline", "sliced", "thread", "process"]

DEFAULT_BUDGET = 0.004  # seconds of sliced work per loop iteration (docs/EXECUTORS.md)
DEFAULT_SHARE = 0.5  # of the time while cheap work is in progress (docs/EXECUTORS.md)


def default_usage_file(keyring_file: Path) -> Path:
    """Where the file key store's usage counts live, beside the keyring:
    ``keyring.json`` -> ``keyring.usage.sqlite``."""
    return keyring_file.with_name(keyring_file.stem + ".usage.sqlite")
