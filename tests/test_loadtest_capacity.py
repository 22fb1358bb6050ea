"""``python -m loadtest.capacity``: its measurements run the product's own store code and
count what they claim (briefly; the figures themselves come from a quiet machine)."""

from __future__ import annotations

import pytest

from loadtest import capacity
from loadtest.stores import private_redis


@pytest.mark.slow
def test_nonce_checks_are_counted_batched_and_charged_to_redis() -> None:
    with private_redis() as url:
        batched = capacity.measure_nonces(url, processes=1, concurrency=16, seconds=0.5)
        single = capacity.measure_nonces(url, processes=1, concurrency=1, seconds=0.5)
    assert batched.checks > 16
    assert batched.refused == 0
    assert single.checks > 1
    assert single.refused == 0
    assert batched.checks / batched.batches > 1.5  # the coalescer batched concurrent checks
    assert single.checks == single.batches  # one in flight: one script call per check
    assert batched.redis_cpu_s > 0
    assert batched.per_redis_core > 0


@pytest.mark.slow
def test_key_store_writes_make_one_generation_each(pg_database: str) -> None:
    import psycopg

    result = capacity.measure_writes(pg_database, writers=2, keys=3, seconds=0.5)
    assert result.errors == 0
    assert len(result.latencies) > 0
    with psycopg.connect(pg_database) as conn:
        row = conn.execute("SELECT generation FROM cryptd_keyring").fetchone()
    # initialise (1) + three creates + one generation per measured write
    assert row is not None
    assert row[0] == 1 + 3 + len(result.latencies)
    assert 0 < result.quantile(0.5) <= result.quantile(0.99)


def test_the_rates_derive_from_the_counts() -> None:
    run = capacity.NonceResult(2, 64, 2.0, 10_000, 160, 0, 0.05)
    assert run.per_second == 5_000
    assert run.us_per_check == pytest.approx(5.0)
    assert run.per_redis_core == pytest.approx(200_000)
