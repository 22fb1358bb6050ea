"""A multi-host test bed on one machine: ``python -m loadtest.testbed up|down|status``.

Eleven machines, each a network namespace with its own address on one bridge (see
``testbed_net``): HAProxy (``lb``) in front of three cryptd hosts (``app1..3``, two server
workers each, production settings, TLS off behind the proxy), a Redis primary and replica
(``redis1``, ``redis2``) watched by three Sentinels (``sentinel1..3``), a PostgreSQL primary and
a streaming standby (``pg1``, ``pg2``). Every cryptd host shares the PostgreSQL key store
(``postgresql://pg1,pg2/cryptd?target_session_attrs=read-write``) and the Redis replay store.

``up`` writes the run directory (``/tmp/cryptd-testbed`` unless ``--run-dir``): ``state.json``,
``client.json`` (the load balancer's URL and an admin client's credential), one directory per
machine with its data and log. ``down`` kills every process of the bed, removes the namespaces,
the bridge, the mounts and the run directory, whatever state a crash left. Needs root.

The replay store's URL comes from one place, :meth:`Bed.redis_url`: ``--redis direct`` (the
default) points cryptd at the Redis primary with ``redis://``; ``--redis sentinel`` gives it
``redis+sentinel://sentinel1:26379,…/cryptd`` for a cryptd that speaks Sentinel.

Each cryptd host runs under libfaketime (its wall clock can be stepped, ``testbed_faults``) and
keeps its writable files (audit log, metrics, runtime, temp) on a small tmpfs of its own, which
a fault can fill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from loadtest.testbed_net import (
    BedError,
    create_bridge,
    create_node,
    destroy_network,
    mounts_under,
    namespaces,
    run,
)
from loadtest.testbed_services import (
    check_programs,
    cryptd_start,
    haproxy_start,
    lb_servers,
    pg_connect,
    pg_primary,
    pg_primary_up,
    pg_standby_up,
    prepare_cryptd,
    redis_client,
    redis_primary,
    redis_start,
    sentinel_start,
)
from loadtest.testbed_topology import (
    APPS,
    DATABASE,
    DEFAULT_PREFIX,
    DEFAULT_RUN_DIR,
    DEFAULT_SUBNET,
    REDISES,
    ROLES,
    SENTINELS,
    Bed,
)

# up / down / status ---------------------------------------------------------------------


def up(bed: Bed) -> None:
    check_programs()
    if namespaces(bed.prefix) or (bed.run_dir / "state.json").exists():
        raise BedError(f"a bed is already up ({bed.run_dir}): run down first")
    bed.run_dir.mkdir(parents=True, exist_ok=True)
    bed.run_dir.chmod(0o755)  # postgres reads its data directory below it
    reach = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "test", "-x"]
    if subprocess.run([*reach, str(bed.run_dir)], check=False).returncode != 0:
        raise BedError(f"the postgres user cannot enter {bed.run_dir}: choose another --run-dir")
    bed.save()
    create_bridge(bed.prefix, bed.subnet)
    for role in ROLES:
        create_node(bed.node(role))
    pg_primary_up(bed, "pg1")
    with pg_connect(bed, "pg1") as conn:
        # The standby is not there yet: a synchronous commit would wait for it.
        conn.execute("SET synchronous_commit = local")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    with ThreadPoolExecutor(4) as pool:
        standby = pool.submit(pg_standby_up, bed, "pg2", "pg1")
        redis_start(bed, "redis1", None)
        redis_start(bed, "redis2", "redis1")
        for sentinel in SENTINELS:
            sentinel_start(bed, sentinel)
        standby.result()
    prepare_cryptd(bed)
    with ThreadPoolExecutor(len(APPS)) as pool:
        for future in [pool.submit(cryptd_start, bed, app) for app in APPS]:
            future.result()
    haproxy_start(bed)


def down(run_dir: Path, prefix: str) -> list[str]:
    """Remove everything a bed (up, half up or crashed) left: processes, namespaces, bridge,
    mounts, run directory. Idempotent."""
    if (run_dir / "state.json").exists():
        with contextlib.suppress(Exception):
            prefix = Bed.load(run_dir).prefix
    removed = destroy_network(prefix)
    if run_dir.exists():
        for point in mounts_under(run_dir):
            run(["umount", "-l", str(point)], check=False)
            removed.append(str(point))
        shutil.rmtree(run_dir, ignore_errors=True)
        removed.append(str(run_dir))
    return removed


def status(bed: Bed) -> dict[str, Any]:
    """What each machine is doing now."""
    report: dict[str, Any] = {"url": bed.url, "credential": str(bed.credential), "machines": {}}
    machines: dict[str, Any] = report["machines"]
    for role in ROLES:
        node = bed.node(role)
        machines[role] = {"address": node.address, "processes": len(node.pids())}
    for app in APPS:
        with contextlib.suppress(Exception):
            machines[app]["readyz"] = httpx.get(bed.host_url(app) + "/readyz", timeout=2).json()
    with contextlib.suppress(Exception):
        for app, state in lb_servers(bed).items():
            machines[app]["haproxy"] = state
    for role in REDISES:
        with contextlib.suppress(Exception):
            machines[role]["role"] = redis_client(bed, role).info("replication")["role"]
    report["redis_primary"] = redis_primary(bed)
    report["pg_primary"] = pg_primary(bed)
    report["redis_url"] = bed.redis_url()
    report["keystore_url"] = bed.keystore_url()
    return report


def add_window_options(parser: argparse.ArgumentParser) -> None:
    """The settings a Redis failover's refusal window is made of (docs/SCALE.md)."""
    parser.add_argument(
        "--max-skew", type=int, default=None, metavar="S",
        help="CRYPTD_SIGNATURE_MAX_SKEW of every cryptd host (default: cryptd's, 5): a new "
        "Redis primary refuses requests signed before its epoch + this",
    )  # fmt: skip
    parser.add_argument(
        "--down-after-ms", type=int, default=1000, metavar="MS",
        help="Sentinel's down-after-milliseconds (how long a silent primary takes to be "
        "declared down)",
    )  # fmt: skip


@contextlib.contextmanager
def running(bed: Bed) -> Iterator[Bed]:
    """A bed brought up for the block and taken down after it, whatever happens."""
    try:
        up(bed)
        yield bed
    finally:
        down(bed.run_dir, bed.prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.testbed", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="names of namespaces and links")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET, help="first three bytes of the /24")
    parser.add_argument("--workers", type=int, default=2, help="server workers per cryptd host")
    parser.add_argument(
        "--redis", choices=("direct", "sentinel"), default="direct",
        help="cryptd's replay store: redis:// to the primary, or redis+sentinel:// (a cryptd "
        "with Sentinel support)",
    )  # fmt: skip
    parser.add_argument("--pg-async", action="store_true", help="no synchronous standby")
    add_window_options(parser)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the test bed needs root (network namespaces, mounts)", file=sys.stderr)
        return 2
    if args.command == "down":
        for name in down(args.run_dir, args.prefix):
            print(f"removed {name}")
        return 0
    if args.command == "status":
        if not (args.run_dir / "state.json").exists():
            print(f"no bed in {args.run_dir}", file=sys.stderr)
            return 1
        print(json.dumps(status(Bed.load(args.run_dir)), indent=2, default=str))
        return 0
    bed = Bed(
        args.run_dir,
        args.prefix,
        args.subnet,
        args.workers,
        args.redis,
        not args.pg_async,
        max_skew=args.max_skew,
        sentinel_down_after_ms=args.down_after_ms,
    )
    started = time.monotonic()
    try:
        up(bed)
    except BedError as exc:
        print(
            f"up failed: {exc}\nlogs in {bed.run_dir}; down removes what is left", file=sys.stderr
        )
        return 1
    print(f"test bed up in {time.monotonic() - started:.1f} s: {bed.url}")
    print(f"credential: {bed.credential}")
    print(f"stop it with: python -m loadtest.testbed down --run-dir {bed.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
