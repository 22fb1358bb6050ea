"""The failure log: one JSON line per row that could not be migrated (its id, a reason code
and a message; never a token or plaintext). Appended and fsynced before the checkpoint that
counts it; cut back to the checkpointed length on resume, so each failure appears once."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .model import MigrationRefused


class FailureLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None

    def open(self, offset: int | None) -> None:
        """Start afresh (``offset`` None: the file is emptied) or resume at ``offset``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        handle = os.fdopen(fd, "r+b")
        size = handle.seek(0, os.SEEK_END)
        if offset is not None and size < offset:
            handle.close()
            raise MigrationRefused(
                f"the failure log {self.path} is shorter ({size} bytes) than its checkpoint says "
                f"({offset}); it was changed or truncated, so the run cannot resume safely"
            )
        handle.truncate(offset or 0)
        handle.seek(0, os.SEEK_END)
        self._handle = handle

    def append(self, entries: Iterable[dict[str, Any]]) -> int:
        """Write ``entries`` durably; return the log's new length."""
        handle = self._handle
        data = b"".join(json.dumps(e, default=str).encode() + b"\n" for e in entries)
        if data:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return int(handle.tell())

    def tell(self) -> int:
        return int(self._handle.tell()) if self._handle is not None else 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
