"""Sliding-window quantiles: accuracy against exact order statistics, mergeability, ageing."""

from __future__ import annotations

import math
import random
import time

import orjson
import pytest

from service.metrics.window import RELATIVE_ACCURACY, SlidingWindow, bin_multiplier, decode, merge

HTTP = ("http", "/v1/encrypt/{key}", "POST")
CRYPTO = ("crypto", "sign", "rsa-2048")


def exact_quantile(values: list[float], q: float) -> float:
    """The order statistic DDSketch estimates: index floor(q * (n - 1)) of the sorted values."""
    ordered = sorted(values)
    return ordered[math.floor(q * (len(ordered) - 1))]


def within_accuracy(estimate: float, exact: float) -> bool:
    return abs(estimate - exact) <= RELATIVE_ACCURACY * exact * (1 + 1e-9)


def latencies(seed: int, n: int) -> list[float]:
    """Log-uniform between 50 us and 50 ms, with a 2 % tail up to 2 s."""
    rng = random.Random(seed)
    values = [math.exp(rng.uniform(math.log(5e-5), math.log(5e-2))) for _ in range(n)]
    values += [rng.uniform(0.05, 2.0) for _ in range(n // 50)]
    return values


def test_quantiles_are_within_relative_accuracy_of_exact_order_statistics() -> None:
    window = SlidingWindow(60.0)
    values = latencies(1, 20_000)
    for value in values:
        window.add(HTTP, value)
    merged = merge([window.snapshot()], window_seconds=60.0, quantiles=(0.5, 0.9, 0.99, 0.999))
    summary = merged[HTTP]
    assert summary.count == len(values)
    for q, estimate in summary.quantiles.items():
        assert within_accuracy(estimate, exact_quantile(values, q)), q


def test_merging_processes_equals_one_sketch_of_everything_not_an_average() -> None:
    fast, slow = SlidingWindow(60.0), SlidingWindow(60.0)
    fast_values = [0.001] * 900
    slow_values = [0.1] * 100
    for value in fast_values:
        fast.add(HTTP, value)
    for value in slow_values:
        slow.add(HTTP, value)
    merged = merge([fast.snapshot(), slow.snapshot()], window_seconds=60.0)[HTTP]
    both = fast_values + slow_values
    assert merged.count == 1000
    assert within_accuracy(merged.quantiles[0.5], exact_quantile(both, 0.5))
    assert within_accuracy(merged.quantiles[0.99], exact_quantile(both, 0.99))
    # Averaging the per-process P50s would claim ~50 ms for a service whose median is 1 ms.
    assert merged.quantiles[0.5] < 0.0011


def test_weights_count_as_repeated_observations() -> None:
    weighted, repeated = SlidingWindow(60.0), SlidingWindow(60.0)
    weighted.add(CRYPTO, 0.0003, 64)
    weighted.add(CRYPTO, 0.02, 2)
    for _ in range(64):
        repeated.add(CRYPTO, 0.0003)
    repeated.add(CRYPTO, 0.02)
    repeated.add(CRYPTO, 0.02)
    a = merge([weighted.snapshot()], window_seconds=60.0, quantiles=(0.5, 0.99))[CRYPTO]
    b = merge([repeated.snapshot()], window_seconds=60.0, quantiles=(0.5, 0.99))[CRYPTO]
    assert a == b
    assert a.count == 66


def test_series_are_kept_apart() -> None:
    window = SlidingWindow(60.0)
    window.add(HTTP, 0.001)
    window.add(CRYPTO, 0.05)
    merged = merge([window.snapshot()], window_seconds=60.0)
    assert within_accuracy(merged[HTTP].quantiles[0.5], 0.001)
    assert within_accuracy(merged[CRYPTO].quantiles[0.5], 0.05)


def test_observations_leave_the_window_once_older_than_it() -> None:
    window = SlidingWindow(60.0)
    window.add(HTTP, 0.001)
    snapshot = window.snapshot()
    now = time.time()
    assert merge([snapshot], window_seconds=60.0, now=now)[HTTP].count == 1
    # 54 s later the slot is at most 55 s old and still inside; 61 s later it is out.
    assert merge([snapshot], window_seconds=60.0, now=now + 54.0)[HTTP].count == 1
    assert merge([snapshot], window_seconds=60.0, now=now + 61.0) == {}


def test_zero_and_negative_durations_are_recorded_as_one_nanosecond() -> None:
    window = SlidingWindow(60.0)
    window.add(HTTP, 0.0)
    window.add(HTTP, -1e-6)
    summary = merge([window.snapshot()], window_seconds=60.0)[HTTP]
    assert summary.count == 2
    assert within_accuracy(summary.quantiles[0.5], 1e-9)


def test_snapshots_made_with_another_configuration_are_not_merged() -> None:
    five_minutes = SlidingWindow(300.0)
    five_minutes.add(HTTP, 0.001)
    coarse = SlidingWindow(60.0, relative_accuracy=0.05)
    coarse.add(HTTP, 0.001)
    assert merge([five_minutes.snapshot(), coarse.snapshot()], window_seconds=60.0) == {}


def test_malformed_snapshots_are_skipped_and_decode_refuses_them() -> None:
    good = SlidingWindow(60.0)
    good.add(HTTP, 0.002)
    broken = [b"", b"{}", b"not json", orjson.dumps({"format": 99, "slots": []})]
    merged = merge([*broken, good.snapshot()], window_seconds=60.0)
    assert merged[HTTP].count == 1
    for blob in broken:
        with pytest.raises(ValueError, match="window"):
            decode(blob)


def test_reset_forgets_everything() -> None:
    window = SlidingWindow(60.0)
    window.add(HTTP, 0.001)
    window.reset()
    assert merge([window.snapshot()], window_seconds=60.0) == {}
    assert not window.changed


def test_invalid_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="window_seconds"):
        SlidingWindow(0.0)
    with pytest.raises(ValueError, match="slots"):
        SlidingWindow(60.0, slots=0)


def test_inline_binning_matches_the_ddsketch_mapping() -> None:
    """Bins are computed inline for speed; they must be the library mapping's keys, or the
    quantile values it reads back would not carry its accuracy guarantee."""
    window = SlidingWindow(60.0)
    multiplier = bin_multiplier(window.mapping)
    rng = random.Random(3)
    values = [math.exp(rng.uniform(math.log(1e-7), math.log(100.0))) for _ in range(50_000)]
    for value in values:
        assert math.ceil(math.log2(value) * multiplier) == window.mapping.key(value)


def test_snapshots_reserialize_only_what_changed_and_stay_complete() -> None:
    window = SlidingWindow(60.0)
    window.add(HTTP, 0.001)
    first = window.snapshot()
    window.add_many([(HTTP, 0.002, 1.0), (CRYPTO, 0.004, 3.0)])
    window.add(HTTP, 0.003)
    second = window.snapshot()
    third = window.snapshot()  # nothing changed: the same bytes
    assert third == second
    assert merge([first], window_seconds=60.0)[HTTP].count == 1
    merged = merge([second], window_seconds=60.0)
    assert merged[HTTP].count == 3
    assert merged[CRYPTO].count == 3
    assert decode(second).slots == decode(third).slots
