"""The checkpoint file: how far a migration got, so a killed run resumes where it stopped.

The rows' own state is the truth; the checkpoint is a position in the source plus the counts
up to it. A SQL source writes the checkpoint *before* it commits a page, with that page marked
``pending`` and a witness (one row's id and the new token written to it): on resume, the
witness row holding exactly that (random, never repeated) token proves the commit landed, so a
kill between the commit and the next checkpoint neither re-does nor skips a page. A file source
writes its output first and the checkpoint after; on resume the output is cut back to the
checkpointed length.

A complete checkpoint is not the end of a SQL migration: the application may have written
rows under the old key meanwhile (a compare-and-set conflict, a writer not yet switched). The
same command then starts pass N+1 over the whole table, from the start, under the same
checkpoint; ``pass_number`` says which pass the counts and the position belong to.

Each write replaces the file atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.fileio import atomic_write

from .model import Counts, MigrationRefused

FORMAT = "cryptd-migrate-checkpoint/1"


@dataclass(slots=True)
class Snapshot:
    """Everything up to ``position`` is done; ``failures_offset`` is the failure log's length."""

    position: Any
    counts: Counts
    failures_offset: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "counts": self.counts.to_json(),
            "failures_offset": self.failures_offset,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Snapshot:
        return cls(data["position"], Counts.from_json(data["counts"]), int(data["failures_offset"]))


@dataclass(slots=True)
class State:
    committed: Snapshot
    pending: Snapshot | None = None
    witness: Any = None
    done: bool = False
    pass_number: int = 1  # passes over the source under this checkpoint, this one included


class CheckpointFile:
    """One migration's checkpoint. ``binding`` (source, keys, column) must match on resume."""

    def __init__(self, path: Path, binding: dict[str, Any]) -> None:
        self.path = path
        self.binding = binding

    def load(self) -> State | None:
        """The saved state, or None when there is no checkpoint yet."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT:
                raise ValueError("unknown format")
            committed = Snapshot.from_json(data["committed"])
            pending = Snapshot.from_json(data["pending"]) if data.get("pending") else None
            pass_number = int(data.get("pass", 1))  # absent in checkpoints of earlier releases
            if pass_number < 1:
                raise ValueError(f"pass {pass_number}")
            state = State(
                committed, pending, data.get("witness"), bool(data.get("done")), pass_number
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise MigrationRefused(
                f"{self.path} is not a migration checkpoint ({exc}); give another --checkpoint"
            ) from None
        if data.get("binding") != self.binding:
            raise MigrationRefused(
                f"the checkpoint {self.path} belongs to another migration "
                f"({json.dumps(data.get('binding'), sort_keys=True)}); this one is "
                f"{json.dumps(self.binding, sort_keys=True)}. Give another --checkpoint file."
            )
        return state

    def save(self, state: State) -> None:
        document = {
            "format": FORMAT,
            "binding": self.binding,
            "done": state.done,
            "pass": state.pass_number,
            "committed": state.committed.to_json(),
            "pending": state.pending.to_json() if state.pending is not None else None,
            "witness": state.witness,
        }
        atomic_write(self.path, json.dumps(document, indent=1).encode() + b"\n")
