"""The cap on keys labelled in ``cryptd_key_operations_total``.

Key names are client-chosen and unbounded in number; every one labelled is a set of series in
every scrape. The first ``max_keys`` keys counted get a label of their own, for good: a key
labelled once stays labelled, so no series ever stops or moves. Every later key is counted
under ``key="_other"`` (with ``version="_other"``). With several server workers the choice is
shared through a file in the multiprocess directory, under a lock, so a replica exposes at
most ``max_keys`` keys however many workers it runs; the file is read only the first time a
process counts a key (flush time, never a request).
"""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

from service.metrics.multiproc import KEY_LABELS_FILE

OTHER = "_other"


class KeyLabels:
    def __init__(self, max_keys: int, directory: Path | None = None) -> None:
        self.max_keys = max_keys
        self._path = None if directory is None else directory / KEY_LABELS_FILE
        self._known: dict[str, bool] = {}
        self._chosen: list[str] = []  # the keys chosen so far, as last read
        self._lock = threading.Lock()

    def labelled(self, name: str) -> bool:
        """Whether ``name`` has a label of its own (decided once per process and key)."""
        found = self._known.get(name)
        if found is None:
            with self._lock:
                try:
                    found = self._known[name] = self._decide(name)
                except OSError:  # the shared file cannot grow (a full disk): asked again later
                    return False
        return found

    def _decide(self, name: str) -> bool:
        # Once max_keys are chosen the choice never changes: no need to look again.
        if len(self._chosen) < self.max_keys and name not in self._chosen:
            if self._path is None:
                self._chosen.append(name)
            else:
                with open(self._path, "a+", encoding="ascii") as handle:
                    fcntl.flock(handle, fcntl.LOCK_EX)
                    handle.seek(0)
                    chosen = handle.read().split()
                    if name not in chosen and len(chosen) < self.max_keys:
                        handle.write(name + "\n")  # key names hold no whitespace
                        handle.flush()
                        chosen.append(name)
                self._chosen = chosen
        return name in self._chosen
