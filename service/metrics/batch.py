"""Observations made on the event loop, applied once per loop iteration instead of one by one.

Under load an iteration completes several requests (and runs their inline crypto). Each
observation only appends a tuple to a queue; one callback at the end of the iteration applies
the batch: histogram increments aggregated per bucket (n observations cost one increment per
bucket touched plus one for the sum, instead of 2n, each an mmap write in multiprocess mode)
and the latency window's bins under one lock. The metrics lag the
responses by at most one loop iteration: a scrape, itself a later request, sees every request
answered before it.

Observations made outside an event loop (executor threads, tests) are applied at once.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from bisect import bisect_left
from typing import Any

from service.metrics.window import SeriesKey, SlidingWindow

# histogram child, window series, value, weight
_Entry = tuple[Any, SeriesKey, float, int]


class LoopBatch:
    def __init__(self, window: SlidingWindow) -> None:
        self._window = window
        self._pending: collections.deque[_Entry] = collections.deque()
        self._scheduled_on: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    def observe(self, histogram: Any, series: SeriesKey, value: float, weight: int = 1) -> None:
        """``weight`` observations of ``value`` on a labelled prometheus-client histogram and
        the window's ``series``."""
        loop = self._loop
        # asyncio.get_running_loop() makes a getpid() system call (fork detection) on every
        # call, which costs far more inside a busy server than its few instructions suggest;
        # the loop found once is reused while this thread is still running it.
        if loop is None or threading.get_ident() != self._loop_thread or not loop.is_running():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._apply_one(histogram, series, value, weight)
                return
            self._loop, self._loop_thread = loop, threading.get_ident()
        pending = self._pending
        pending.append((histogram, series, value, weight))
        # A flush is due when the queue was empty, or when the one scheduled belongs to another
        # loop (one that ended before running it: a test's, or a restarted one).
        if len(pending) == 1 or self._scheduled_on is not loop:
            self._scheduled_on = loop
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Apply everything queued. Safe from any thread: deque pops are atomic, so each
        observation is applied exactly once whoever flushes."""
        pending = self._pending
        self._scheduled_on = None
        if len(pending) == 1:  # a quiet iteration: nothing to aggregate
            try:
                entry = pending.popleft()
            except IndexError:  # another thread flushed it
                return
            self._apply_one(*entry)
            return
        histograms: dict[Any, list[tuple[float, int]]] = {}
        window: list[tuple[SeriesKey, float, int]] = []
        while True:
            try:
                histogram, series, value, weight = pending.popleft()
            except IndexError:
                break
            values = histograms.get(histogram)
            if values is None:
                histograms[histogram] = [(value, weight)]
            else:
                values.append((value, weight))
            window.append((series, value, weight))
        for histogram, values in histograms.items():
            apply(histogram, values)
        if window:
            self._window.add_many(window)

    def _apply_one(self, histogram: Any, series: SeriesKey, value: float, weight: int) -> None:
        if weight == 1:
            histogram.observe(value)
        else:
            apply(histogram, [(value, weight)])
        self._window.add(series, value, weight)

    def reset(self) -> None:
        """In a forked child: the parent's queued observations are the parent's, and its
        loop is not running here."""
        self._pending = collections.deque()
        self._scheduled_on = None
        self._loop = None


def apply(child: Any, values: list[tuple[float, int]]) -> None:
    """Observe each (value, weight) on ``child``: one increment per bucket touched, one for the
    sum.

    prometheus-client keeps one non-cumulative count per bucket (it accumulates at scrape time)
    and the sum; writing those directly is what the corresponding observe() calls would do. A
    test pins the equivalence; a prometheus-client without those attributes gets observe().
    """
    if (len(values) == 1 and values[0][1] == 1) or not supports_direct_buckets(child):
        for value, weight in values:
            for _ in range(weight):
                child.observe(value)
        return
    bounds = child._upper_bounds
    counts: dict[int, int] = {}
    total = 0.0
    for value, weight in values:
        index = bisect_left(bounds, value)
        counts[index] = counts.get(index, 0) + weight
        total += value * weight
    buckets = child._buckets
    for index, count in counts.items():
        buckets[index].inc(count)
    child._sum.inc(total)


_direct_buckets: bool | None = None


def supports_direct_buckets(child: Any) -> bool:
    """Whether prometheus-client's histogram children have the attributes apply() writes to
    (checked once: every child comes from the same library)."""
    global _direct_buckets
    if _direct_buckets is None:
        _direct_buckets = all(hasattr(child, a) for a in ("_upper_bounds", "_buckets", "_sum"))
    return _direct_buckets
