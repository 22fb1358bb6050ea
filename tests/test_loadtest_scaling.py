"""loadtest.scaling's arithmetic: CPU per request without the idle share, and the 2-worker
ratio against 1 worker in the table (the live run is a benchmark, smoke-run by hand)."""

from __future__ import annotations

import pytest

from loadtest.scaling import Row, configurations, table


def test_cpu_per_request_without_idle_subtracts_the_idle_cpu_per_request() -> None:
    row = Row("default", 2, cpu_us=[120.0, 110.0, 130.0], idle_cpu=[0.02], rps=[1000.0])
    # 0.02 cores idle at 1000 req/s is 20 us a request.
    assert row.busy_us == pytest.approx(100.0)


def test_the_table_gives_two_workers_against_one_per_configuration() -> None:
    rows = [
        Row("default", 1, cpu_us=[100.0], idle_cpu=[0.0], rps=[1000.0]),
        Row("default", 2, cpu_us=[115.0], idle_cpu=[0.004], rps=[1000.0], busiest_share=[0.6]),
    ]
    text = table(rows, 1000.0)
    assert "| default | 2 | 115.0 | 111.0 | 0.004 | 60% | +11.0% |" in text
    assert "| default | 1 | 100.0 | 100.0 | 0.000 |  |  |" in text


def test_replay_in_redis_is_measured_only_with_a_redis() -> None:
    assert "replay-redis" not in configurations(None)
    assert configurations("redis://127.0.0.1:6379/11")["replay-redis"] == {
        "CRYPTD_REDIS_URL": "redis://127.0.0.1:6379/11"
    }
    assert configurations(None)["metrics-off"] == {"CRYPTD_METRICS": "false"}
