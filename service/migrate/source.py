"""The interface every source (SQL table, JSONL file, CSV file) implements.

A source knows storage only: how to read rows in a stable order, where it stands, how to write
new tokens back. It knows nothing of keys, HTTP or checkpoints; the engine hands it a callback
that makes the checkpoint durable at the right moment of the write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .model import Page

# Called by Source.write once the page's changes are in place: ``conflicts`` are indexes of
# rows that could not be written (they changed since they were read); ``witness`` is None when
# the write is already durable, or a value for Source.landed() when it becomes durable only
# with the commit that follows the callback.
Written = Callable[[Sequence[int], Any], None]


class Source(Protocol):
    def identity(self) -> dict[str, Any]:
        """What the checkpoint is bound to (no secrets: a URL without its password)."""
        ...

    def start(self, position: Any | None) -> int | None:
        """Prepare to read after ``position`` (None: from the start; outputs are cut back to
        the position on resume). Return how many rows remain, if known."""
        ...

    def read(self, limit: int) -> Page | None:
        """The next page of at most ``limit`` rows, or None at the end."""
        ...

    def write(self, page: Page, changes: Sequence[tuple[int, str]], written: Written) -> None:
        """Replace the tokens of ``page.rows[index]`` for each (index, token) in ``changes``;
        call ``written`` exactly once, before the write is committed."""
        ...

    def landed(self, witness: Any) -> bool:
        """Whether the write that produced ``witness`` was committed."""
        ...

    def close(self) -> None: ...
