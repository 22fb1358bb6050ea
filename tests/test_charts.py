"""Charts: ``cryptd bench --chart`` and the load-test report's chart are real PNGs with the
figures drawn (not blank), made by matplotlib (the charts extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # the charts extra; CI installs it
from matplotlib import image

from loadtest.algorithms import rates
from loadtest.algorithms.table import TITLES
from loadtest.charts import algorithms_chart, comparison_chart

pytestmark = pytest.mark.slow  # benchmarks and matplotlib

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _assert_drawn(path: Path, min_width: int = 800) -> None:
    assert path.read_bytes()[:8] == PNG
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert width >= min_width
    assert height >= 400
    # Bars in several colours, not an empty canvas: many distinct colours.
    colours = {tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
    assert len(colours) > 20


@pytest.fixture(scope="module")
def small_report() -> rates.Report:
    return rates.run(seconds=0.02, sizes=[16, 1024], threads=1, with_gmssl=False, rounds=1)


def test_algorithms_chart(small_report: rates.Report, tmp_path: Path) -> None:
    path = algorithms_chart(small_report, tmp_path / "bench.png", TITLES)
    _assert_drawn(path)


def test_cryptd_bench_chart_option(tmp_path: Path) -> None:
    chart = tmp_path / "out" / "sm2.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "bench",
            "--seconds",
            "0.02",
            "--rounds",
            "1",
            "--sizes",
            "16",
            "--threads",
            "1",
            "--no-gmssl",
            "--chart",
            str(chart),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    _assert_drawn(chart)
    # The text speaks of the product, not of a bar it had to clear.
    for word in ("issue", "MISSED", "goal"):
        assert word not in done.stdout


def _summary(ops: float, p99: float) -> dict[str, float]:
    return {"ops": ops, "p50_ms": p99 / 3, "p99_ms": p99, "errors": 0}


def test_load_test_report_chart(tmp_path: Path) -> None:
    results = {
        "started": "2026-12-01T10:00:00Z",
        "config": {"connections": 16, "duration": 10, "rounds": 3, "workers": 2},
        "comparisons": [
            {
                "scenario": "aes-encrypt",
                "title": "AES-256-GCM encrypt 1 KiB",
                "cryptd": _summary(5952, 5.6),
                "openbao": _summary(8379, 27.4),
            },
            {
                "scenario": "sm2-sign",
                "title": "SM2 sign (cryptd only)",
                "cryptd": _summary(2575, 10.8),
                "openbao": None,
            },
        ],
        "case_study": {"rate": 500, "cryptd": {"p99_ms": 2.73}, "openbao": {"p99_ms": 4.19}},
    }
    path = comparison_chart(results, tmp_path / "load.png")
    _assert_drawn(path)
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(results))
    again = tmp_path / "again.png"
    subprocess.run(
        [sys.executable, "-m", "loadtest.charts", str(saved), str(again)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    _assert_drawn(again)
