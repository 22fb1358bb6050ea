"""Batch limits by key type: a batch that cannot finish within the pool deadline is refused up
front (413), instead of burning a core until the deadline answers 503 and the client retries.

The table is the CPU cost of one item on one busy core of the reference host (2 vCPUs shared
with load; measured through ``operations.run_batch``, rounded up: a quiet core does RSA-4096
decrypt in ~1.5 ms, a loaded one in 4-10 ms). Operations not listed cost under ~100 us an
item: ``CRYPTD_MAX_BATCH_ITEMS`` of them take well under a second, so only that limit applies.
A batch may use ``BUDGET_SHARE`` of the deadline on one core: the rest is for the queue ahead
of it and the other requests sharing the pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from service.errors import PayloadTooLarge

# Microseconds per item, by (key type, operation). rewrap decrypts under the key and encrypts
# under the target: both costs, the target counted as the same type.
_PRIVATE: Final = ("decrypt", "sign")
_PUBLIC: Final = ("encrypt", "verify", "datakey")


def _rsa(private: int, public: int) -> dict[str, int]:
    return {
        **dict.fromkeys(_PRIVATE, private),
        **dict.fromkeys(_PUBLIC, public),
        "rewrap": private + public,
    }


ITEM_COST_US: Final[Mapping[str, Mapping[str, int]]] = MappingProxyType(
    {
        "rsa-2048": _rsa(1_000, 100),
        "rsa-3072": _rsa(2_500, 150),
        "rsa-4096": _rsa(5_000, 250),
        "sm2": {
            "encrypt": 2_500,
            "datakey": 2_500,
            "decrypt": 1_000,
            "rewrap": 3_500,
            "sign": 1_500,
            "verify": 1_000,
        },
        "ecdsa-p384": {"sign": 1_000, "verify": 2_000},
        "ecdsa-p521": {"sign": 1_000, "verify": 2_000},
    }
)
BUDGET_SHARE: Final = 0.5


class BatchLimits:
    """The most items one batch of an operation on a key type may hold: ``max_items``, lowered
    to what fits in ``BUDGET_SHARE`` of ``deadline`` at the table's cost, or ``configured``
    for that key type (``CRYPTD_MAX_BATCH_ITEMS_BY_TYPE``) in place of the derived value."""

    def __init__(
        self, max_items: int, deadline: float, configured: Mapping[str, int] | None = None
    ) -> None:
        self.max_items = max_items
        self.deadline = deadline
        self._configured = dict(configured or {})
        self._limits: dict[tuple[str, str], int] = {}

    def limit(self, type_name: str, op: str) -> int:
        found = self._limits.get((type_name, op))
        if found is None:
            configured = self._configured.get(type_name)
            if configured is not None:
                found = min(self.max_items, configured)
            else:
                cost = ITEM_COST_US.get(type_name, {}).get(op)
                fits = (
                    self.max_items
                    if cost is None
                    else int(self.deadline * BUDGET_SHARE * 1_000_000 // cost)
                )
                found = max(1, min(self.max_items, fits))
            self._limits[(type_name, op)] = found
        return found

    def check(self, type_name: str, op: str, items: int) -> None:
        """413 ``payload_too_large`` when ``items`` is over the limit, naming it."""
        limit = self.limit(type_name, op)
        if items > limit:
            raise PayloadTooLarge(
                f"a {type_name} {op} batch holds at most {limit} items "
                f"({items} sent): split it into smaller batches"
            )
