"""Several server worker processes, each listening on its own ``SO_REUSEPORT`` socket.

uvicorn's own supervisor shares one listening socket among its workers, and whichever worker
wakes first accepts every connection waiting: a burst of new connections (a client's pool
opening, a load balancer reconnecting) lands on one worker. Here 16 connections opened at once
split 16/0, 15/1, 13/3 or 12/4 in 8 of 10 trials, and the busy worker's core did all the work
while the other idled. With one ``SO_REUSEPORT`` socket per worker the kernel spreads
connections over the workers by their address hash (Linux lets only processes of the same user
join such a group).

The supervisor starts the workers, replaces one that dies, stops everything when a worker
cannot start (a broken configuration fails the same way every time), passes SIGHUP on to every
worker (each reloads its keyring), and on SIGTERM or SIGINT asks every worker to drain
(uvicorn's graceful shutdown) before it exits. In a container it is PID 1, so it also does an
init's other job: processes orphaned by a dead worker (its process-pool workers) are reparented
to it (it declares itself a child subreaper, so this holds outside containers too) and their
exit status is collected, so none stays a zombie.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

import uvicorn

from service.edge.server import EdgeServer, bind

log = logging.getLogger("cryptd.supervisor")

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
WORKER_INDEX_VARIABLE = "CRYPTD_WORKER_INDEX"  # Settings.worker_index of each worker
STARTUP_FAILURE = 3  # uvicorn's exit status for a worker whose startup failed
FAST_FAILURE_SECONDS = 10.0  # a worker that fails this soon after its start is not retried
CHECK_INTERVAL = 0.5


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) in the address's reuse-port group."""
    if port == 0:
        raise ValueError("several workers need a fixed port (port 0 gives each its own)")
    return bind(host, port, reuse_port=True)


def become_subreaper() -> bool:
    """Have orphaned descendants reparented to this process (Linux PR_SET_CHILD_SUBREAPER)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_orphans(exclude: set[int | None]) -> list[int]:
    """Collect the exit status of exited children other than ``exclude`` (the workers, which
    multiprocessing joins itself). Returns the pids collected."""
    reaped = []
    for pid in _children() - {pid for pid in exclude if pid is not None}:
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                reaped.append(pid)
    return reaped


def _children() -> set[int]:
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                found.update(int(pid) for pid in (task / "children").read_text().split())
    return found


def run_worker(
    config: uvicorn.Config, index: int = 0, setup: Callable[[], object] | None = None
) -> None:
    """One server worker (in its own process): its own socket, then uvicorn as usual.
    ``index``: 0 .. workers - 1, taken over by the worker that replaces a dead one.
    ``setup``: the process's logging, run first (a spawned process starts with none: its start
    lines, such as the TLS certificate's, would be lost and uvicorn's access logger would
    write through the root handler the app installs later)."""
    os.environ[WORKER_INDEX_VARIABLE] = str(index)
    if setup is not None:
        setup()
    config.configure_logging()  # what uvicorn's own supervisor does in every worker
    # A SIGHUP passed on while this worker still starts must not end it (the default action);
    # the app installs its keyring-reload handler at startup, and loads the keyring then anyway.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    EdgeServer(config).run(sockets=[listening_socket(config.host, config.port)])


class Supervisor:
    def __init__(
        self,
        config: uvicorn.Config,
        workers: int,
        *,
        grace: float,
        setup: Callable[[], object] | None = None,
    ) -> None:
        """``grace``: how long stopping workers may drain before they are killed; ``setup``:
        picklable, run first in every worker (its logging)."""
        self.config = config
        self.setup = setup
        self.workers = workers
        self.grace = grace
        self._stop = threading.Event()
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (status 0) or a worker fails to start (status 1)."""
        listening_socket(self.config.host, self.config.port).close()  # fail early: port taken?
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGHUP, self._forward)
        become_subreaper()
        # The same list the SIGHUP handler reads: replacements are seen there too.
        processes = self._processes = [self._start(index) for index in range(self.workers)]
        started = [time.monotonic()] * self.workers
        failed = False
        while not self._stop.wait(CHECK_INTERVAL):
            for index, process in enumerate(processes):
                if process.is_alive():
                    continue
                process.join()
                code = process.exitcode or 0  # negative: killed by a signal, worth a retry
                if code == STARTUP_FAILURE or (
                    code > 0 and time.monotonic() - started[index] < FAST_FAILURE_SECONDS
                ):
                    log.error(
                        "server worker failed to start; stopping",
                        extra={"pid": process.pid, "exit_code": process.exitcode},
                    )
                    failed = True
                    self._stop.set()
                    break
                log.warning(
                    "server worker exited; starting another",
                    extra={"pid": process.pid, "exit_code": process.exitcode},
                )
                processes[index] = self._start(index)
                started[index] = time.monotonic()
            reap_orphans(exclude={process.pid for process in processes})
        self._stop_all(processes)
        return 1 if failed else 0

    def _start(self, index: int) -> BaseProcess:
        process = self._context.Process(
            target=run_worker, args=(self.config, index, self.setup), daemon=False
        )
        process.start()
        return process

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        for process in self._processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    def _stop_all(self, processes: list[BaseProcess]) -> None:
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: the worker drains its requests, then exits
        deadline = time.monotonic() + self.grace
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error(
                    "server worker did not stop in time; killing it", extra={"pid": process.pid}
                )
                process.kill()
                process.join()
