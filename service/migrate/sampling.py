"""Which migrated rows ``--verify`` decrypts under both keys."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence


class Sampler:
    """Selection sampling (Knuth's algorithm S) over the migrated rows: each is picked with
    probability needed / rows remaining, which spreads ``needed`` picks evenly over the table.
    Called by the workers once a page is rewrapped (pages in any order, hence the lock); a row
    that did not migrate is never picked, so up to ``needed`` rows are verified (fewer only if
    the last rows of the table did not migrate)."""

    def __init__(self, needed: int, total: int | None) -> None:
        self.needed = max(0, needed)
        self.remaining = max(total or 0, self.needed)
        self._random = random.SystemRandom()
        self._lock = threading.Lock()

    def pick(self, migrated: Sequence[int], rows: int) -> list[int]:
        """Of a page of ``rows`` rows, the indexes to verify among ``migrated`` (ascending)."""
        chosen: list[int] = []
        with self._lock:
            if self.needed <= 0:
                return chosen
            candidates = set(migrated)
            for index in range(rows):
                if self.needed <= 0:
                    self.remaining -= rows - index
                    break
                pick = self._random.random() * max(self.remaining, 1) < self.needed
                if index in candidates and pick:
                    chosen.append(index)
                    self.needed -= 1
                self.remaining -= 1
        return chosen
