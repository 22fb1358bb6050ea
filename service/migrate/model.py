"""What flows through a migration: rows, their outcomes, pages and the running counts."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class MigrationRefused(ValueError):
    """Nothing could succeed: a bad argument, a missing column, an unusable key. Raised before
    anything is written; the message says what to change."""


class RunStopped(RuntimeError):
    """The run cannot go on (service unreachable, credentials refused, a key became unusable,
    the database failed). Everything committed so far is in the checkpoint: fix the cause and
    run the same command again to resume."""


class Kind(enum.IntEnum):
    MIGRATED = 0
    SKIPPED = 1
    FAILED = 2


# Why a row is skipped.
SKIP_ALREADY = "already_under_target"
SKIP_NULL = "null"

# Why a row failed (besides the service's own error codes, e.g. decryption_failed).
FAIL_NOT_A_TOKEN = "not_a_token"  # noqa: S105 (a reason code, not a secret)
FAIL_DAMAGED = "damaged_token"
FAIL_OTHER_KEY = "other_key_type"
FAIL_CHANGED = "changed_during_migration"
FAIL_DUPLICATE_ID = "duplicate_id"
FAIL_NULL_ID = "null_id"
FAIL_BAD_RECORD = "bad_record"
FAIL_NOT_TEXT = "not_text"
FAIL_VERIFY = "verify_mismatch"


class Outcome(NamedTuple):
    kind: Kind
    token: str | None = None  # MIGRATED: the new token
    reason: str = ""  # SKIPPED / FAILED: a short code
    message: str = ""  # FAILED: what went wrong, never data

    @staticmethod
    def migrated(token: str) -> Outcome:
        return Outcome(Kind.MIGRATED, token)

    @staticmethod
    def skipped(reason: str) -> Outcome:
        return Outcome(Kind.SKIPPED, None, reason)

    @staticmethod
    def failed(reason: str, message: str) -> Outcome:
        return Outcome(Kind.FAILED, None, reason, message)


@dataclass(slots=True)
class Page:
    """Rows read in order, by column: ``ids`` (a SQL row's id, a file record's number),
    ``tokens`` (None for NULL or absent), ``aads`` (None: no associated data for any row).
    ``failures`` holds rows the source already knows cannot be migrated (a duplicate id, a
    record that is not JSON); ``end`` is the JSON-able position just after the last row."""

    ids: list[Any]
    tokens: list[str | None]
    aads: list[bytes | None] | None
    end: Any
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)
    extra: Any = None  # what the source needs to write the page back (raw records, types)

    def __len__(self) -> int:
        return len(self.ids)

    def aad(self, index: int) -> bytes | None:
        return None if self.aads is None else self.aads[index]


@dataclass(slots=True)
class Counts:
    migrated: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    verified: int = 0
    elapsed: float = 0.0  # seconds of work, summed over the runs of one checkpoint

    @property
    def rows(self) -> int:
        return self.migrated + self.skipped.total() + self.failed.total()

    def add(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if outcome.kind is Kind.MIGRATED:
                self.migrated += 1
            elif outcome.kind is Kind.SKIPPED:
                self.skipped[outcome.reason] += 1
            else:
                self.failed[outcome.reason] += 1

    def copy(self) -> Counts:
        return Counts(
            self.migrated, Counter(self.skipped), Counter(self.failed), self.verified, self.elapsed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "migrated": self.migrated,
            "skipped": dict(sorted(self.skipped.items())),
            "failed": dict(sorted(self.failed.items())),
            "verified": self.verified,
            "elapsed": round(self.elapsed, 3),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Counts:
        return cls(
            migrated=int(data["migrated"]),
            skipped=Counter({str(k): int(v) for k, v in data["skipped"].items()}),
            failed=Counter({str(k): int(v) for k, v in data["failed"].items()}),
            verified=int(data.get("verified", 0)),
            elapsed=float(data.get("elapsed", 0.0)),
        )
