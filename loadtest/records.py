"""Where a run's summary is kept: ``docs/results/DATE-KIND.md``, what docs/PERFORMANCE.md and
the README quote. A second run of the same kind on the same day gets its time added
(``DATE-KIND-HHMM.md``) instead of replacing the file a document may already cite."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Final

RECORDS_DIR: Final = Path(__file__).resolve().parent.parent / "docs" / "results"


def record_path(kind: str, when: dt.datetime, directory: Path = RECORDS_DIR) -> Path:
    """The file for a run of ``kind`` started at ``when`` (UTC), not yet taken."""
    for name in (f"{when:%Y-%m-%d}-{kind}", f"{when:%Y-%m-%d}-{kind}-{when:%H%M}"):
        path = directory / f"{name}.md"
        if not path.exists():
            return path
    return directory / f"{when:%Y-%m-%d}-{kind}-{when:%H%M%S}.md"


def keep(kind: str, text: str, when: dt.datetime, directory: Path = RECORDS_DIR) -> Path:
    """Write ``text`` as the record of a run of ``kind`` started at ``when``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = record_path(kind, when, directory)
    path.write_text(text.rstrip() + "\n")
    return path
