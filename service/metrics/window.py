"""Sliding-window latency quantiles that stay correct when merged across processes.

A quantile cannot be averaged: the P99 of two processes is not the mean of their P99s. Each
process therefore counts its observations in DDSketch bins (logarithmic mapping, relative
accuracy 1 %). Such sketches are *mergeable*: adding two sketches' bin counts gives exactly the
sketch of the union of their observations, so the quantile read from the merged sketch is within
1 % of a true quantile of all processes' observations together.

Time is cut into slots (default 12 x 5 s) aligned to wall-clock multiples of the slot length,
so every process cuts it the same way; a window is the current, partial slot plus the
``slots - 1`` full ones before it, i.e. between ``window - slot`` and ``window`` seconds of data.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson
from ddsketch.ddsketch import BaseDDSketch
from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import DenseStore

log = logging.getLogger("cryptd.metrics")

RELATIVE_ACCURACY = 0.01
DEFAULT_SLOTS = 12
FOLD_BATCH = 256
FORMAT_VERSION = 1

# A latency of zero (or a clock hiccup below it) is recorded as one nanosecond: every value then
# lands in a logarithmic bin and the sketch needs no separate zero count.
_SMALLEST_VALUE = 1e-9

SeriesKey = tuple[str, str, str]
"""(family, label_a, label_b): ("http", route, method) or ("crypto", operation, key_type)."""

Bins = dict[int, float]
"""DDSketch bin key -> count."""


@dataclass(frozen=True, slots=True)
class SeriesWindow:
    """What one series saw over the window: observation count and the requested quantiles."""

    count: float
    quantiles: Mapping[float, float]


def bin_multiplier(mapping: LogarithmicMapping) -> float:
    """``key(v) = ceil(log2(v) * multiplier)``, exactly as LogarithmicMapping computes it
    (``1 / log1p(gamma - 1) * ln 2``, offset 0), without a method call per observation."""
    return 1 / math.log1p(mapping.gamma - 1) * math.log(2)


class SlidingWindow:
    """One process's ring of time slots, each holding DDSketch bins per series.

    Thread-safe: the event loop, executor threads and the publishing thread all use it.
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
        self._multiplier = bin_multiplier(self.mapping)
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[SeriesKey, float, float, float]] = (
            collections.deque()
        )
        self._ring: dict[int, dict[SeriesKey, Bins]] = {}
        self._serialized: dict[int, bytes] = {}  # slot -> its part of the snapshot
        self._dirty: set[int] = set()  # slots changed since they were last serialized
        self._current_slot = -1
        self.changed = False
        """Set by every add(); cleared by whoever publishes the window (under no lock: a lost
        race only delays a publication until the next add or the next interval)."""

    def add(self, series: SeriesKey, value: float, weight: float = 1.0) -> None:
        """Queue one observation (``weight`` identical ones); folded in batches of FOLD_BATCH.

        The request path only appends a tuple: binning there costs several times more than in
        a tight loop later, where the code and data stay in the CPU caches.
        """
        pending = self._pending
        pending.append((series, value, weight, time.time()))
        self.changed = True
        if len(pending) >= FOLD_BATCH:
            self.fold()

    def add_many(self, observations: Iterable[tuple[SeriesKey, float, float]]) -> None:
        """Bin (series, value, weight) observations made just now, under one lock acquisition."""
        log2, ceil, multiplier = math.log2, math.ceil, self._multiplier
        slot = int(time.time() // self.slot_seconds)
        with self._lock:
            if slot > self._current_slot:
                self._advance(slot)
            stores = self._ring[self._current_slot]
            self._dirty.add(self._current_slot)
            for series, value, weight in observations:
                bins = stores.get(series)
                if bins is None:
                    bins = stores[series] = {}
                key = ceil(log2(value if value > _SMALLEST_VALUE else _SMALLEST_VALUE) * multiplier)
                bins[key] = bins.get(key, 0.0) + weight
        self.changed = True

    def fold(self) -> None:
        """Move queued observations into their slot's bins (deque pops are atomic and one
        thread folds at a time, so any thread may call it)."""
        pending = self._pending
        log2, ceil, multiplier = math.log2, math.ceil, self._multiplier
        slot_seconds = self.slot_seconds
        with self._lock:
            ring = self._ring
            while pending:
                series, value, weight, when = pending.popleft()
                slot = int(when // slot_seconds)
                if slot > self._current_slot:
                    self._advance(slot)
                elif slot <= self._current_slot - self.slots:
                    continue  # it left the window while queued
                stores = ring.get(slot)
                if stores is None:
                    stores = ring[slot] = {}
                self._dirty.add(slot)
                bins = stores.get(series)
                if bins is None:
                    bins = stores[series] = {}
                key = ceil(log2(value if value > _SMALLEST_VALUE else _SMALLEST_VALUE) * multiplier)
                bins[key] = bins.get(key, 0.0) + weight

    def _advance(self, slot: int) -> None:
        self._current_slot = slot
        self._ring[slot] = {}
        oldest = slot - self.slots
        for stale in [s for s in self._ring if s <= oldest]:
            del self._ring[stale]
            self._serialized.pop(stale, None)

    def reset(self) -> None:
        """Forget everything (a forked child must not publish its parent's observations)."""
        self._lock = threading.Lock()
        self._pending = collections.deque()
        self._ring = {}
        self._serialized = {}
        self._dirty = set()
        self._current_slot = -1
        self.changed = False

    def snapshot(self) -> bytes:
        """Serialize the slots that are still inside the window (see :func:`decode`).

        A slot is serialized again only if something was added to it since: published every
        second, a 60 s window mostly re-sends slots that no longer change.
        """
        self.fold()
        first = int(time.time() // self.slot_seconds) - self.slots + 1
        with self._lock:
            serialized = self._serialized
            for slot, stores in self._ring.items():
                if slot in self._dirty or slot not in serialized:
                    series = [[*name, list(bins.items())] for name, bins in stores.items()]
                    serialized[slot] = orjson.dumps([slot, series])
            self._dirty.clear()
            slots = b",".join(blob for slot, blob in sorted(serialized.items()) if slot >= first)
        header = orjson.dumps(
            {
                "format": FORMAT_VERSION,
                "slot_seconds": self.slot_seconds,
                "gamma": self.mapping.gamma,
            }
        )
        return header[:-1] + b',"slots":[' + slots + b"]}"


@dataclass(frozen=True, slots=True)
class Decoded:
    slot_seconds: float
    gamma: float
    slots: list[tuple[int, list[tuple[SeriesKey, list[tuple[int, float]]]]]]


def decode(blob: bytes) -> Decoded:
    """Parse a :meth:`SlidingWindow.snapshot`; raises ValueError on anything unexpected."""
    try:
        document = orjson.loads(blob)
        if document["format"] != FORMAT_VERSION:
            raise ValueError(f"unknown window format {document['format']!r}")
        slots = [
            (
                int(slot),
                [
                    ((str(f), str(a), str(b)), [(int(k), float(c)) for k, c in bins])
                    for f, a, b, bins in series
                ],
            )
            for slot, series in document["slots"]
        ]
        return Decoded(float(document["slot_seconds"]), float(document["gamma"]), slots)
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
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
    skipped, as are malformed ones (logged).
    """
    mapping = LogarithmicMapping(relative_accuracy)
    slot_seconds = window_seconds / slots
    first = int((time.time() if now is None else now) // slot_seconds) - slots + 1
    merged: dict[SeriesKey, Bins] = {}
    for blob in snapshots:
        try:
            decoded = decode(blob)
        except ValueError:
            log.warning("skipped a malformed latency window snapshot")
            continue
        if not (
            math.isclose(decoded.slot_seconds, slot_seconds)
            and math.isclose(decoded.gamma, mapping.gamma)
        ):
            continue
        for slot, entries in decoded.slots:
            if slot < first:
                continue
            for name, bins in entries:
                target = merged.setdefault(name, {})
                for key, count in bins:
                    target[key] = target.get(key, 0.0) + count
    return {name: _summarize(mapping, bins, quantiles) for name, bins in merged.items() if bins}


def _summarize(mapping: LogarithmicMapping, bins: Bins, quantiles: Sequence[float]) -> SeriesWindow:
    store = DenseStore()
    keys = sorted(bins)
    # Size the store for the whole key range first: growing it one key at a time re-centres
    # (copies) its bins on every step.
    store.add(keys[0], 0.0)
    store.add(keys[-1], 0.0)
    for key in keys:
        store.add(key, bins[key])
    sketch = BaseDDSketch(mapping, store, DenseStore(), 0.0)
    values: dict[float, float] = {}
    for q in quantiles:
        value = sketch.get_quantile_value(q)
        if value is not None:
            values[q] = float(value)
    return SeriesWindow(count=store.count, quantiles=values)
