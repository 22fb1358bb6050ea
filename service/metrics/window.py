"""Sliding-window latency quantiles that stay correct when merged across processes.

A quantile cannot be averaged: the P99 of two processes is not the mean of their P99s. Each
process therefore records into DDSketch bins (relative accuracy 1 %), which are *mergeable*:
adding two sketches' bin counts gives exactly the sketch of the union of their observations, so
the quantile read from the merged sketch is within 1 % of a true quantile of all processes'
observations together.

Time is cut into slots (default 12 x 5 s) aligned to wall-clock multiples of the slot length,
so every process cuts it the same way; a window is the current, partial slot plus the
``slots - 1`` full ones before it, i.e. between ``window - slot`` and ``window`` seconds of data.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson
from ddsketch.ddsketch import BaseDDSketch
from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import DenseStore

RELATIVE_ACCURACY = 0.01
DEFAULT_SLOTS = 12
FORMAT_VERSION = 1

# A latency of zero (or a clock hiccup below it) is recorded as one nanosecond: every value then
# lands in a logarithmic bin and the sketch needs no separate zero count.
_SMALLEST_VALUE = 1e-9

SeriesKey = tuple[str, str, str]
"""(family, label_a, label_b): ("http", route, method) or ("crypto", operation, key_type)."""


@dataclass(frozen=True, slots=True)
class SeriesWindow:
    """What one series saw over the window: observation count and the requested quantiles."""

    count: float
    quantiles: Mapping[float, float]


class SlidingWindow:
    """One process's ring of time slots, each holding one DDSketch store per series.

    Thread-safe: the event loop, executor threads and the publishing thread all touch it.
    """

    def __init__(
        self,
        window_seconds: float = 60.0,
        slots: int = DEFAULT_SLOTS,
        relative_accuracy: float = RELATIVE_ACCURACY,
    ) -> None:
        if window_seconds <= 0 or slots < 1:
            raise ValueError("window_seconds must be positive and slots at least 1")
        self.window_seconds = float(window_seconds)
        self.slots = slots
        self.slot_seconds = self.window_seconds / slots
        self.mapping = LogarithmicMapping(relative_accuracy)
        self._key = self.mapping.key
        self._lock = threading.Lock()
        self._ring: dict[int, dict[SeriesKey, DenseStore]] = {}
        self._current_slot = -1
        self._current: dict[SeriesKey, DenseStore] = {}
        self.changed = False
        """Set by every add(); cleared by whoever publishes the window (under no lock: a lost
        race only delays a publication until the next add or the next interval)."""

    def add(self, series: SeriesKey, value: float, weight: float = 1.0) -> None:
        slot = int(time.time() // self.slot_seconds)
        key = self._key(value if value > _SMALLEST_VALUE else _SMALLEST_VALUE)
        with self._lock:
            # A clock stepping backwards keeps filling the newest slot rather than reopening
            # an old one.
            if slot > self._current_slot:
                self._advance(slot)
            store = self._current.get(series)
            if store is None:
                store = self._current[series] = DenseStore()
            store.add(key, weight)
        self.changed = True

    def _advance(self, slot: int) -> None:
        self._current_slot = slot
        self._current = self._ring[slot] = {}
        oldest = slot - self.slots
        for stale in [s for s in self._ring if s <= oldest]:
            del self._ring[stale]

    def reset(self) -> None:
        """Forget everything (a forked child must not publish its parent's observations)."""
        self._lock = threading.Lock()
        self._ring = {}
        self._current_slot = -1
        self._current = {}
        self.changed = False

    def snapshot(self) -> bytes:
        """Serialize the slots that are still inside the window (see :func:`decode`)."""
        first = int(time.time() // self.slot_seconds) - self.slots + 1
        slots: list[list[object]] = []
        with self._lock:
            for slot, stores in self._ring.items():
                if slot < first:
                    continue
                series = [
                    [*name, store.min_key, store.bins[store.min_key - store.offset :
                                                      store.max_key - store.offset + 1]]
                    for name, store in stores.items()
                    if store.count > 0
                ]
                slots.append([slot, series])
        return orjson.dumps(
            {
                "format": FORMAT_VERSION,
                "slot_seconds": self.slot_seconds,
                "gamma": self.mapping.gamma,
                "slots": slots,
            }
        )


@dataclass(frozen=True, slots=True)
class _Decoded:
    slot_seconds: float
    gamma: float
    slots: list[tuple[int, list[tuple[SeriesKey, int, list[float]]]]]


def decode(blob: bytes) -> _Decoded:
    """Parse a :meth:`SlidingWindow.snapshot`; raises ValueError on anything unexpected."""
    try:
        document = orjson.loads(blob)
        if document["format"] != FORMAT_VERSION:
            raise ValueError(f"unknown window format {document['format']!r}")
        slots: list[tuple[int, list[tuple[SeriesKey, int, list[float]]]]] = []
        for slot, series in document["slots"]:
            entries = [
                ((str(f), str(a), str(b)), int(first), [float(c) for c in counts])
                for f, a, b, first, counts in series
            ]
            slots.append((int(slot), entries))
        return _Decoded(float(document["slot_seconds"]), float(document["gamma"]), slots)
    except (KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"malformed window snapshot: {type(exc).__name__}") from None


def merge(
    snapshots: Iterable[bytes],
    *,
    window_seconds: float,
    slots: int = DEFAULT_SLOTS,
    relative_accuracy: float = RELATIVE_ACCURACY,
    quantiles: Sequence[float] = (0.5, 0.99),
    now: float | None = None,
) -> dict[SeriesKey, SeriesWindow]:
    """Merge every snapshot's in-window slots and read the quantiles of each series.

    Snapshots made with another slot length or accuracy cannot be merged bin by bin and are
    skipped (a configuration mismatch between processes, reported by the caller's count).
    """
    mapping = LogarithmicMapping(relative_accuracy)
    slot_seconds = window_seconds / slots
    first = int((time.time() if now is None else now) // slot_seconds) - slots + 1
    bins: dict[SeriesKey, dict[int, float]] = {}
    for blob in snapshots:
        decoded = decode(blob)
        if not (
            math.isclose(decoded.slot_seconds, slot_seconds)
            and math.isclose(decoded.gamma, mapping.gamma)
        ):
            continue
        for slot, entries in decoded.slots:
            if slot < first:
                continue
            for name, first_key, counts in entries:
                target = bins.setdefault(name, {})
                for offset, count in enumerate(counts):
                    if count:
                        key = first_key + offset
                        target[key] = target.get(key, 0.0) + count
    result: dict[SeriesKey, SeriesWindow] = {}
    for name, counts_by_key in bins.items():
        store = DenseStore()
        for key in sorted(counts_by_key):
            store.add(key, counts_by_key[key])
        sketch = BaseDDSketch(mapping, store, DenseStore(), 0.0)
        values = {q: float(sketch.get_quantile_value(q)) for q in quantiles}
        result[name] = SeriesWindow(count=store.count, quantiles=values)
    return result
