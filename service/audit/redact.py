"""Sensitive request values as ``hmac-sha256:<hex>`` under the deployment's salt (as Vault's
audit devices do): an auditor holding a known value can find it, the log never holds it."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable

HMAC_KEY = "cryptd:audit-hmac"
HMAC_KEY_TYPE = "hmac-sha256"
PREFIX = "hmac-sha256:"

Mac = Callable[[bytes], bytes]
"""mac(value) -> HMAC-SHA256 tag under the deployment's audit key."""


def salted(key: bytes) -> Mac:
    def mac(value: bytes) -> bytes:
        return hmac.new(key, value, "sha256").digest()

    return mac


def hashed(mac: Mac, value: bytes | str) -> str:
    return PREFIX + mac(value.encode() if isinstance(value, str) else value).hex()


def hashed_all(mac: Mac, values: Iterable[bytes]) -> list[str]:
    """Each distinct value once, in first-seen order (a batch repeats its AAD)."""
    seen: dict[bytes, None] = dict.fromkeys(values)
    return [hashed(mac, value) for value in seen]
