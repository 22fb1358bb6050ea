"""The interface every source (SQL table, JSONL file, CSV file) implements.

A source knows storage only: how to read rows in a stable order, where it stands, how to write
new tokens back. It knows nothing of keys, HTTP or checkpoints; the engine hands it a callback
that makes the checkpoint durable at the right moment of the write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .model import Page

# New tokens for one page: (row index in the page, token).
Changes = Sequence[tuple[int, str]]

# Called by Source.write once a group's changes are in place: ``conflicts`` are (page number
# in the group, row index) of rows that could not be written (they changed since they were
# read); ``witness`` is None when the write is already durable, or a value for
# Source.landed() when it becomes durable only with the commit that follows the callback.
Written = Callable[[Sequence[tuple[int, int]], Any], None]


class Source(Protocol):
    # Whether a later pass over the source can find work a complete pass left: true for a
    # table (other writers change it), false for a file (its input never changes, and its
    # output is written once).
    repeatable: bool

    def identity(self) -> dict[str, Any]:
        """What the checkpoint is bound to (no secrets: a URL without its password)."""
        ...

    def start(self, position: Any | None) -> int | None:
        """Prepare to read after ``position`` (None: from the start; outputs are cut back to
        the position on resume). Return how many rows remain, if known."""
        ...

    def position(self) -> Any:
        """Where the source stands now (after start: where reading begins)."""
        ...

    def read(self, limit: int) -> Page | None:
        """The next page of at most ``limit`` rows, or None at the end."""
        ...

    def write(self, group: Sequence[tuple[Page, Changes]], written: Written) -> None:
        """Write back a group of consecutive pages, in order and all or nothing: for each page,
        replace the token of row ``index`` by ``token`` for each (index, token) of its changes.
        Call ``written`` exactly once, before the group is committed."""
        ...

    def landed(self, witness: Any) -> bool:
        """Whether the write that produced ``witness`` was committed."""
        ...

    def close(self) -> None: ...
