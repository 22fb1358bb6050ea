"""Installing the logging of a process: JSON on stderr, the access log, the audit stream."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.logs.access import AccessLog
from service.logs.audit import Audit
from service.logs.handler import JsonHandler
from service.logs.writer import LineWriter

LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


@dataclass
class LogSetup:
    """What :func:`configure_logging` built: pass ``access_log`` to the request timer
    (service/api/timing.py) and ``audit`` to whatever manages keys and runs decrypt/sign;
    ``close()`` at shutdown."""

    access_log: AccessLog | None
    audit: Audit
    writers: list[LineWriter]

    def flush(self, timeout: float = 5.0) -> None:
        for writer in self.writers:
            writer.flush(timeout)

    def close(self) -> None:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, JsonHandler)]:
            root.removeHandler(handler)
        for writer in self.writers:
            writer.close()


_current: LogSetup | None = None

_URL_LOGGERS = ("httpx", "httpcore", "urllib3")
# uvicorn's plain-text access line: cryptd writes its own (service/logs/access.py) or none.
_SERVER_ACCESS_LOGGER = "uvicorn.access"


def configure_logging(
    level: str,
    access_log: bool,
    audit_target: str,
    *,
    stderr_fd: int | None = None,
) -> LogSetup:
    """Install JSON logging on the root logger at ``level``; build the access log (None when
    off or when ``level`` hides info lines) and the audit stream (``"stderr"``, ``"off"`` or a
    file path, opened append-only, mode 0600). Calling it again replaces the previous setup.

    Call it in every process that logs, first thing (each server worker before its
    configuration loads, as the TLS files are loaded then; pool workers log little and may
    inherit it through fork). Servers should not install their own access log or handlers
    (uvicorn: ``log_config=None, access_log=False``).
    """
    global _current
    numeric = LEVELS.get(level.lower())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    if _current is not None:
        _current.close()
    stderr = LineWriter(stderr_fd if stderr_fd is not None else _stderr_fd())
    writers = [stderr]
    if audit_target == "off":
        audit = Audit(None)
    elif audit_target == "stderr":
        audit = Audit(stderr)
    else:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        audit_writer = LineWriter(os.open(Path(audit_target), flags, 0o600), owns_fd=True)
        writers.append(audit_writer)
        audit = Audit(audit_writer)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, JsonHandler) or _writes_to_console(handler):
            root.removeHandler(handler)  # plain-text duplicates of every line
    root.addHandler(JsonHandler(stderr))
    root.setLevel(numeric)
    for name in _URL_LOGGERS:  # they log full URLs, query strings included, at info and debug
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    # A logger that reaches no handler makes uvicorn skip its access line (and the cost of
    # formatting it) for every request; through the root handler it would be a second line.
    server_access = logging.getLogger(_SERVER_ACCESS_LOGGER)
    server_access.handlers.clear()
    server_access.propagate = False
    access = AccessLog(stderr) if access_log and numeric <= logging.INFO else None
    _current = LogSetup(access_log=access, audit=audit, writers=writers)
    return _current


def _writes_to_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return type(handler) is logging.StreamHandler and stream in (sys.stderr, sys.stdout)


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by a test harness
        return 2


def _close_at_exit() -> None:
    if _current is not None:
        _current.close()


atexit.register(_close_at_exit)
# Processes started by multiprocessing (uvicorn's workers) end with os._exit(), which skips
# atexit: their finalizers run instead, so the last lines still reach stderr.
multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=0)
