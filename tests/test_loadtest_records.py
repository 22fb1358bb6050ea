"""Where a run's summary is kept: a second run the same day never replaces the first's file,
which a document may already cite."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from loadtest import records


def test_a_second_run_the_same_day_gets_its_time_added(tmp_path: Path) -> None:
    morning = dt.datetime(2026, 12, 6, 5, 43, 33, tzinfo=dt.UTC)
    first = records.keep("tls", "first run\n\n", morning, tmp_path)
    assert first == tmp_path / "2026-12-06-tls.md"
    assert first.read_text() == "first run\n"
    second = records.keep("tls", "second run", morning.replace(hour=6, minute=12), tmp_path)
    assert second == tmp_path / "2026-12-06-tls-0612.md"
    third = records.keep("tls", "third run", morning.replace(hour=6, minute=12), tmp_path)
    assert third == tmp_path / "2026-12-06-tls-061233.md"
    assert first.read_text() == "first run\n"  # never replaced
    assert second.read_text() == "second run\n"
    # Another kind, or another day, starts again at the plain name.
    assert records.record_path("scaling", morning, tmp_path).name == "2026-12-06-scaling.md"
    next_day = morning + dt.timedelta(days=1)
    assert records.record_path("tls", next_day, tmp_path).name == "2026-12-07-tls.md"
