"""Faults the test bed can suffer, one function each, and the repair an operator's automation
would make afterwards. Every function returns what it did and how long the parts took.

- :func:`kill_host` / :func:`restart_host`: SIGKILL every process of a cryptd host (a power
  cut), then start it again.
- :func:`kill_redis_primary`: SIGKILL the Redis primary; the Sentinels promote the replica.
  :func:`restart_redis` brings the old one back (Sentinel makes it a replica).
  :func:`failover_timeline` says afterwards where the refusal window went.
- :func:`kill_pg_primary`: SIGKILL the PostgreSQL primary and promote the standby (``pg_ctl
  promote``; the new primary stops waiting for a synchronous standby it no longer has).
  :func:`rebuild_pg_standby` makes the old one a fresh standby of the new primary.
- :func:`cut_links`: a host's link down for N seconds (cut off from the databases and the
  load balancer alike).
- :func:`step_clock`: a host's wall clock stepped by N seconds (libfaketime; the namespace
  shares the kernel's clock, so the step is per process). :func:`step_clock` with 0 undoes it.
- :func:`fill_disk` / :func:`free_disk`: the host's writable tmpfs filled to the last byte.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import re
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.testbed_net import BedError, run
from loadtest.testbed_services import (
    as_postgres,
    cryptd_start,
    pg_bin,
    pg_primary,
    pg_set_sync,
    pg_standby_up,
    redis_client,
    redis_primary,
    redis_start,
    wait_for,
)
from loadtest.testbed_topology import APPS, PGS, REDISES, SENTINELS, Bed
from service.auth.replay import KEY_PREFIX
from service.auth.signature import DEFAULT_MAX_SKEW


@dataclass
class FaultRecord:
    """What a fault did: its name, the machine, when (monotonic seconds) and details."""

    fault: str
    target: str
    started: float
    ended: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    wall: float = 0.0  # time.time() when the fault struck (for the machines' logs)


def kill_host(bed: Bed, app: str) -> FaultRecord:
    if app not in APPS:
        raise BedError(f"{app} is not a cryptd host")
    record = FaultRecord("kill -9 host", app, time.monotonic())
    record.details["processes"] = bed.node(app).kill()
    record.ended = time.monotonic()
    return record


def restart_host(bed: Bed, app: str) -> float:
    """Start the host's cryptd again; seconds until its /readyz answered 200."""
    started = time.monotonic()
    cryptd_start(bed, app)
    return time.monotonic() - started


def kill_redis_primary(bed: Bed, timeout: float = 30.0) -> FaultRecord:
    """SIGKILL the Redis primary and wait for the Sentinels to name the other one."""
    old = redis_primary(bed)
    if old is None:
        raise BedError("the Sentinels name no Redis primary")
    record = FaultRecord("kill -9 Redis primary", old, time.monotonic())
    killed_wall = time.time()
    bed.node(old).kill()
    killed = time.monotonic()
    new = next(r for r in REDISES if r != old)

    def promoted() -> bool:
        role = redis_client(bed, new).info("replication")["role"]
        return redis_primary(bed) == new and role == "master"

    wait_for(f"Sentinel promoting {new}", promoted, timeout)
    record.ended = time.monotonic()
    record.details.update(promoted=new, promotion_s=round(record.ended - killed, 3))
    record.wall = killed_wall
    return record


# A Sentinel log line: "<pid>:X 05 Dec 2026 10:36:20.302 * +switch-master cryptd ...".
_SENTINEL_EVENT = re.compile(
    r"^\d+:X (\d\d \w{3} \d{4} \d\d:\d\d:\d\d\.\d{3}) . "
    r"(\+sdown master|\+odown master|\+switch-master) "
)
_REACHED = "replay store answers again"


def failover_timeline(bed: Bed, killed: float, new: str) -> dict[str, float]:
    """Where a Redis failover's refusal window went, in seconds after the kill (``killed``:
    wall clock): the Sentinels' detection (first ``+sdown`` and ``+odown`` of the master) and
    switch (``+switch-master``), from their logs; cryptd reaching the new primary (each host's
    first "replay store answers again" after the kill, at most 0.1 s late: the first and the
    last host); the end of the new primary's epoch window (its epoch plus the hosts' max skew:
    the first signature time it accepts). Call it once the window is over."""
    found: dict[str, float] = {}
    names = {"+sdown master": "sdown_s", "+odown master": "odown_s", "+switch-master": "switch_s"}
    for sentinel in SENTINELS:
        log = bed.directory(sentinel) / "sentinel.log"
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                match = _SENTINEL_EVENT.match(line)
                if match is None:
                    continue
                # Sentinel writes local time, to the millisecond.
                at = datetime.datetime.strptime(match[1], "%d %b %Y %H:%M:%S.%f").timestamp()
                name = names[match[2]]
                if at >= killed - 0.01 and at - killed < found.get(name, float("inf")):
                    found[name] = at - killed
    reached: list[float] = []
    for app in APPS:
        with contextlib.suppress(OSError):
            text = (bed.directory(app) / "cryptd.log").read_text(errors="replace")
            for line in text.splitlines():
                if _REACHED not in line or not line.startswith('{"ts":"'):
                    continue
                stamp = line[7 : line.index('"', 7)].replace("Z", "+00:00")
                at = datetime.datetime.fromisoformat(stamp).timestamp()
                if at >= killed:
                    reached.append(at - killed)
                    break
    if reached:
        found["cryptd_reached_first_s"] = min(reached)
        found["cryptd_reached_last_s"] = max(reached)
    with contextlib.suppress(Exception):
        epoch = redis_client(bed, new).get(f"{KEY_PREFIX}epoch")
        skew = bed.max_skew if bed.max_skew is not None else DEFAULT_MAX_SKEW
        if epoch is not None:
            found["epoch_window_end_s"] = int(epoch) + skew - killed
    return {name: round(value, 3) for name, value in found.items()}


def restart_redis(bed: Bed, role: str) -> float:
    """Bring a killed Redis back as a replica of the current primary."""
    started = time.monotonic()
    primary = redis_primary(bed)
    redis_start(bed, role, primary)
    return time.monotonic() - started


def kill_pg_primary(bed: Bed) -> FaultRecord:
    """SIGKILL the PostgreSQL primary, promote the standby, let it commit alone."""
    old = pg_primary(bed)
    if old is None:
        raise BedError("no PostgreSQL primary")
    new = next(p for p in PGS if p != old)
    record = FaultRecord("kill -9 PostgreSQL primary, promote standby", old, time.monotonic())
    bed.node(old).kill()
    killed = time.monotonic()
    argv = as_postgres([pg_bin("pg_ctl"), "-D", str(bed.directory(new) / "data"), "-w", "promote"])
    run(bed.node(new).command(argv), timeout=60)
    # Its only standby is gone: a synchronous commit would wait for ever.
    pg_set_sync(bed, new, "")
    record.ended = time.monotonic()
    record.details.update(promoted=new, promotion_s=round(record.ended - killed, 3))
    return record


def rebuild_pg_standby(bed: Bed, role: str) -> float:
    """The old primary made a fresh standby of the new one; synchronous again if the bed is."""
    started = time.monotonic()
    primary = pg_primary(bed)
    if primary is None or primary == role:
        raise BedError(f"no other primary to rebuild {role} from")
    pg_standby_up(bed, role, primary)
    if bed.pg_sync:
        pg_set_sync(bed, primary, "ANY 1 (*)")
    return time.monotonic() - started


def cut_links(bed: Bed, app: str, seconds: float) -> FaultRecord:
    """The host's only link down for ``seconds`` (blocks meanwhile), then up again."""
    record = FaultRecord(f"links cut {seconds:g} s", app, time.monotonic())
    node = bed.node(app)
    node.link(up=False)
    try:
        time.sleep(seconds)
    finally:
        node.link(up=True)
    record.ended = time.monotonic()
    return record


def step_clock(bed: Bed, app: str, seconds: float) -> FaultRecord:
    """Every process of the host sees the wall clock ``seconds`` off from now on (0: back to
    the true time). CLOCK_MONOTONIC is left alone, as an NTP step leaves it."""
    record = FaultRecord(f"clock {seconds:+g} s", app, time.monotonic())
    bed.faketime_file(app).write_text(f"{seconds:+g}\n")
    # libfaketime re-reads the file at most once a second (FAKETIME_CACHE_DURATION).
    time.sleep(1.2)
    record.ended = time.monotonic()
    return record


def fill_disk(bed: Bed, app: str) -> FaultRecord:
    """Fill the host's writable tmpfs until the kernel says ENOSPC."""
    record = FaultRecord("disk full", app, time.monotonic())
    filler = bed.disk(app) / "filler"
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as out:
        while True:
            try:
                written += out.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    record.ended = time.monotonic()
    record.details["filled_bytes"] = written
    return record


def free_disk(bed: Bed, app: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (bed.disk(app) / "filler").unlink()


__all__ = [
    "FaultRecord",
    "cut_links",
    "fill_disk",
    "free_disk",
    "kill_host",
    "kill_pg_primary",
    "kill_redis_primary",
    "rebuild_pg_standby",
    "restart_host",
    "restart_redis",
    "step_clock",
]
