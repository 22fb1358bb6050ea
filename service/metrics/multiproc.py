"""prometheus-client multiprocess mode: the shared directory's life cycle and the window files.

Life cycle of ``PROMETHEUS_MULTIPROC_DIR``:

1. ``cryptd serve`` calls :func:`init_multiprocess_dir` once, before any worker starts. Files left
   by a previous run would be summed into this run's counters, so they are removed, and the
   variable is exported so that every worker and pool process inherits it.
2. Every process writes its own files, named by pid: prometheus-client's ``<type>_<pid>.db``
   (mmap'ed, updated on every observation) and this package's ``window_<pid>.json`` (the
   latency window, rewritten at most once a second).
3. A dead worker's counter and histogram files stay: the merged totals then keep growing across a
   restart. Deleting them would make counters go backwards, which Prometheus reads as a reset and
   double counts in ``rate()``. Its *live* gauges (queue depth, in flight) must go, or a dead
   worker's last queue depth would be summed forever: :func:`mark_worker_dead` removes them, and
   :func:`reap_dead_processes` (run on every scrape) does it for processes that disappeared
   without anyone calling it, as uvicorn restarts workers without telling the application.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from pathlib import Path

from prometheus_client import values
from prometheus_client.multiprocess import mark_process_dead

from service.metrics import mmapfile
from service.metrics.window import SlidingWindow

log = logging.getLogger("cryptd.metrics")

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"

_METRIC_FILE = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_\d+\.db\Z")
_WINDOW_FILE = re.compile(r"window_(\d+)\.json\Z")
_WINDOW_TEMP = re.compile(r"\.window_\d+\.tmp\Z")
_METRIC_TEMP = re.compile(r"\.(counter|histogram|summary|gauge_[a-z]+)_\d+\.db\.new\Z")  # mmapfile
_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db\Z")
_PROCESS_MARKER = re.compile(r"process_\d+\Z")  # service/metrics/process.py
KEY_LABELS_FILE = "key_labels.txt"  # service/metrics/labels.py: this run's labelled keys

_activated: Path | None = None
_activation_lock = threading.Lock()


def init_multiprocess_dir(path: Path) -> None:
    """Create ``path`` (or empty it of a previous run's metric files) and export it.

    Only files this package or prometheus-client write are removed, so a mistaken path (a home
    directory, ``/tmp``) loses nothing else.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in path.iterdir():
        name = entry.name
        if entry.is_file() and (
            _METRIC_FILE.match(name)
            or _WINDOW_FILE.match(name)
            or _WINDOW_TEMP.match(name)
            or _METRIC_TEMP.match(name)
            or name == KEY_LABELS_FILE
            or _PROCESS_MARKER.match(name)
        ):
            entry.unlink(missing_ok=True)
    os.environ[ENV_VAR] = str(path)


def mark_worker_dead(pid: int, path: Path | None = None) -> None:
    """Drop a dead process's live gauges; its counters, histograms and window stay (see above)."""
    directory = path if path is not None else env_dir()
    if directory is None:
        return
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


def reap_dead_processes(path: Path, window_seconds: float) -> list[int]:
    """Mark dead every process that owns live-gauge files but no longer exists; delete window
    files of dead processes once all they hold has left the window. Returns the reaped pids."""
    live_gauge_pids: set[int] = set()
    window_files: dict[int, Path] = {}
    for entry in path.iterdir():
        if found := _LIVE_GAUGE_FILE.match(entry.name):
            live_gauge_pids.add(int(found.group(1)))
        elif found := _WINDOW_FILE.match(entry.name):
            window_files[int(found.group(1))] = entry
    reaped = [pid for pid in sorted(live_gauge_pids) if not _alive(pid)]
    for pid in reaped:
        mark_process_dead(pid, str(path))  # type: ignore[no-untyped-call]
    horizon = time.time() - 2 * window_seconds
    for pid, entry in window_files.items():
        with contextlib.suppress(FileNotFoundError):
            if entry.stat().st_mtime < horizon and not _alive(pid):
                entry.unlink()
    return reaped


def read_windows(path: Path) -> list[bytes]:
    """Every process's latest published window snapshot."""
    blobs: list[bytes] = []
    for entry in path.iterdir():
        if _WINDOW_FILE.match(entry.name):
            with contextlib.suppress(FileNotFoundError):
                blobs.append(entry.read_bytes())
    return blobs


def activate(path: Path) -> None:
    """Make prometheus-client keep this process's values in files under ``path``.

    prometheus-client picks its value class when it is first imported, from the environment.
    It is replaced here, before this process creates any metric (cryptd creates all of its
    metrics through Metrics, which calls this first), by one that names its files after a
    cached pid: the stock one calls getpid() on every increment to notice a fork, and a system
    call per observation costs a busy server far more than its few instructions suggest. The
    cache is refreshed in a forked child (os.register_at_fork), so a fork is still noticed.
    One directory per process.
    """
    global _activated
    resolved = path.resolve()
    with _activation_lock:
        if _activated is not None and _activated != resolved:
            raise ValueError("this process already writes metrics to another directory")
        if not resolved.is_dir():
            raise ValueError(f"metrics directory {path} does not exist")
        os.environ[ENV_VAR] = str(resolved)
        mmapfile.install()  # before the first file is opened: a full disk is no SIGBUS
        if not getattr(values.ValueClass, "_cryptd_cached_pid", False):
            value_class = values.MultiProcessValue(cached_pid)  # type: ignore[no-untyped-call]
            value_class._cryptd_cached_pid = True
            values.ValueClass = value_class
        _activated = resolved


_pid = os.getpid()


def cached_pid() -> int:
    """This process's pid, without a system call."""
    return _pid


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)


def is_multiprocess() -> bool:
    """Whether prometheus-client in this process keeps values in files."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


def env_dir() -> Path | None:
    value = os.environ.get(ENV_VAR)
    return Path(value) if value else None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WindowPublisher:
    """Writes a process's latency window to ``window_<pid>.json``, at most once per
    ``interval`` and only when something was recorded, from a daemon thread.

    The file is replaced atomically (write a temporary file, rename), so a scrape reads either
    the previous snapshot or the new one, never half of one.
    """

    def __init__(self, window: SlidingWindow, directory: Path, interval: float = 1.0) -> None:
        self._window = window
        self._directory = directory
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._failing = False
        self.started = False

    def start(self) -> None:
        """Start the thread (lazily, on the first observation of this process)."""
        with self._write_lock:
            if self.started:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, name="cryptd-metrics-window", daemon=True
            )
            self._thread.start()
            self.started = True

    def after_fork(self) -> None:
        """In a forked child: the thread did not survive the fork, and the lock may be held."""
        self._write_lock = threading.Lock()
        self._thread = None
        self.started = False

    def _run(self) -> None:
        stop = self._stop
        while not stop.wait(self._interval):
            if self._window.changed:
                self._publish_quietly()

    def _publish_quietly(self) -> None:
        try:
            self.publish()
        except OSError as exc:  # a full disk must not kill the thread: retried next interval
            if not self._failing:  # once per episode, not every interval
                log.warning("could not publish the latency window: %s", type(exc).__name__)
            self._failing = True
        else:
            self._failing = False

    def publish(self) -> None:
        with self._write_lock:
            self._window.changed = False
            blob = self._window.snapshot()
            pid = os.getpid()
            temporary = self._directory / f".window_{pid}.tmp"
            temporary.write_bytes(blob)
            os.replace(temporary, self._directory / f"window_{pid}.json")

    def stop(self) -> None:
        """Stop the thread and publish what is left (called at shutdown)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._thread = None
        self.started = False
        if self._window.changed:
            self._publish_quietly()
