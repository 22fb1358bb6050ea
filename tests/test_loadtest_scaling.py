"""loadtest.scaling's arithmetic (CPU per request without the idle share, the 2-worker ratio
against 1 worker in the table) and one short live run at full load, pinned."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.scaling import Row, configurations, table

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_per_request_without_idle_subtracts_the_idle_cpu_per_request() -> None:
    row = Row("default", 2, cpu_us=[120.0, 110.0, 130.0], idle_cpu=[0.02], rps=[1000.0])
    # 0.02 cores idle at 1000 req/s is 20 us a request.
    assert row.busy_us == pytest.approx(100.0)


def test_the_table_gives_two_workers_against_one_per_configuration() -> None:
    rows = [
        Row("default", 1, cpu_us=[100.0], idle_cpu=[0.0], rps=[1000.0]),
        Row("default", 2, cpu_us=[115.0], idle_cpu=[0.004], rps=[1000.0], busiest_share=[0.6]),
    ]
    text = table(rows, "offered 1,000 req/s open loop")
    assert text.startswith("Load: offered 1,000 req/s open loop; server CPU from /proc.")
    assert "| default | 2 | 115.0 | 111.0 | 0.004 | 60% | +11.0% |" in text
    assert "| default | 1 | 100.0 | 100.0 | 0.000 |  |  |" in text


def test_replay_in_redis_is_measured_only_with_a_redis() -> None:
    assert "replay-redis" not in configurations(None)
    assert configurations("redis://127.0.0.1:6379/11")["replay-redis"] == {
        "CRYPTD_REDIS_URL": "redis://127.0.0.1:6379/11"
    }
    assert configurations(None)["metrics-off"] == {"CRYPTD_METRICS": "false"}


@pytest.mark.slow
def test_a_short_saturated_run_measures_one_and_two_workers_per_configuration(
    tmp_path: Path,
) -> None:
    if shutil.which("wrk") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("wrk is required under CI (apt-get install -y wrk luajit)")
        pytest.skip("wrk is not installed (apt-get install -y wrk luajit)")
    out = tmp_path / "scaling.md"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.scaling", "--saturated", "--rounds", "1",
         "--duration", "1", "--idle", "0.3", "--redis", "none", "--connections", "4",
         "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "wrk's closed loop at full load (4 connections)" in text
    assert "shared cores: servers and load generators on the same" in text  # the default
    for configuration in ("default", "metrics-off", "usage-rare"):
        one = re.search(rf"^\| {configuration} \| 1 \| ([\d.]+) \|", text, re.MULTILINE)
        two = re.search(
            rf"^\| {configuration} \| 2 \| ([\d.]+) \|.*\| ([+-][\d.]+)% \|$", text, re.MULTILINE
        )
        assert one is not None, text
        assert two is not None, text
        # A request costs tens to thousands of microseconds of server CPU, whatever the host.
        assert 5 < float(one.group(1)) < 20_000
        assert 5 < float(two.group(1)) < 20_000
    assert "Errors: 0." in text
