"""One short run of the migration benchmark (``python -m loadtest.migrate_bench``): both
measurements, the memory series and the PostgreSQL writers, on tiny tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_migrate_benchmark_smoke(tmp_path: Path, pg_database: str) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.migrate_bench",
            "--aes-rows",
            "1500",
            "--rsa-rows",
            "60",
            "--rounds",
            "1",
            "--batch-size",
            "100",
            "--memory",
            "200,1500",
            "--writers",
            "600",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    cases = {(c["database"], c["pair"]): c for c in document["cases"]}
    assert set(cases) == {
        ("sqlite", "aes"),
        ("postgresql", "aes"),
        ("sqlite", "rsa"),
        ("postgresql", "rsa"),
    }
    for case in cases.values():
        assert {r["what"] for r in case["runs"]} == {"rewrap", "migrate"}
        assert all(r["rows"] == case["rows"] for r in case["runs"])
        assert case["ratio"] > 0
    assert [m["rows"] for m in document["memory"]] == [200, 1500]
    assert all(m["peak_rss_mb"] > 10 for m in document["memory"])
    assert {w["writer"] for w in document["writers"]} == {
        "postgresql",
        "pg-copy",
        "pg-executemany",
        "generic",
    }
    assert "| sqlite | aes256-gcm -> sm4-gcm |" in done.stdout
