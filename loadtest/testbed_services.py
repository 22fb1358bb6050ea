"""Starting the test bed's machines: PostgreSQL (primary and streaming standby), Redis and
its Sentinels, the cryptd hosts (production settings, libfaketime, a small tmpfs each) and
HAProxy; and asking each what it is doing.

Over 400 lines because each machine's start is a configuration file written out whole (the
settings a reader of a report needs to see, in the order the service's own documentation
gives them) next to the command that starts it; splitting them per machine would scatter the
bed's addresses and ports, which they share."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Container
from glob import glob
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis

from loadtest.testbed_net import BedError, Node, mounts_under, need, run
from loadtest.testbed_topology import (
    APPS,
    CLIENT_ID,
    CRYPTD_PORT,
    FAKETIME_LIBS,
    HOST_DISK,
    PG_PORT,
    PGS,
    REDIS_PORT,
    REDIS_SERVICE,
    REDISES,
    SENTINEL_PORT,
    SENTINELS,
    SITECUSTOMIZE,
    STARTUP_TIMEOUT,
    Bed,
)
from service.auth.clients import generate_secret, write_document

# Programs -------------------------------------------------------------------------------


def pg_bin(program: str) -> str:
    """PostgreSQL's own binary (the newest /usr/lib/postgresql/*/bin first)."""
    found = sorted(glob(f"/usr/lib/postgresql/*/bin/{program}"), key=_version)
    return found[-1] if found else need(program)


def _version(path: str) -> int:
    part = Path(path).parts[-3]
    return int(part) if part.isdigit() else 0


def faketime_lib() -> str:
    for path in FAKETIME_LIBS:
        if Path(path).exists():
            return path
    raise BedError("libfaketime is not installed (Debian package faketime)")


def check_programs() -> None:
    """Every program the bed runs, so a missing one fails before anything is created."""
    for program in ("ip", "setsid", "setpriv", "mount", "haproxy", "redis-server"):
        need(program)
    for program in ("initdb", "pg_ctl", "pg_basebackup"):
        pg_bin(program)
    faketime_lib()


def spawn(node: Node, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Start ``argv`` in ``node``'s namespace, detached from this process (``setsid -f``):
    the bed outlives the command that brought it up; ``down`` finds it by namespace."""
    with open(log, "ab") as out:
        subprocess.run(
            ["setsid", "-f", *node.command(argv)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            check=True,
            timeout=30,
        )


def as_postgres(argv: list[str]) -> list[str]:
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv]


def wait_for(
    what: str, probe: Any, timeout: float = STARTUP_TIMEOUT, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if probe():
                return
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise BedError(f"{what}: not ready after {timeout:.0f} s\n{tail}")
        time.sleep(0.2)


# PostgreSQL -----------------------------------------------------------------------------


def pg_connect(bed: Bed, role: str, dbname: str = "postgres") -> psycopg.Connection[Any]:
    return psycopg.connect(
        host=bed.node(role).address,
        port=PG_PORT,
        user="postgres",
        dbname=dbname,
        connect_timeout=2,
        autocommit=True,
    )


def pg_primary(bed: Bed) -> str | None:
    """The PostgreSQL machine that accepts writes now, if any."""
    for role in PGS:
        with contextlib.suppress(psycopg.Error), pg_connect(bed, role) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            if row is not None and not row[0]:
                return role
    return None


def pg_start(bed: Bed, role: str, attempts: int = 3) -> None:
    """Start the machine's PostgreSQL; tried again a moment later when it does not come up
    (a start right after a SIGKILL of the same machine can still find the dead server's
    resources), and the error carries the server log's last lines, which the bed's teardown
    removes."""
    data = bed.directory(role) / "data"
    log = bed.directory(role) / "postgres.log"
    argv = as_postgres(
        [pg_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "start"]
    )
    for attempt in range(attempts):
        try:
            run(bed.node(role).command(argv), timeout=90)
            return
        except BedError as exc:
            tail = log.read_text(errors="replace").splitlines()[-8:] if log.exists() else []
            if attempt == attempts - 1:
                raise BedError(f"{exc}; {role}'s log ends: {' | '.join(tail)}") from None
            print(f"{role}: PostgreSQL did not start ({' | '.join(tail[-2:])}); again")
            time.sleep(2.0)


def _pg_settings(bed: Bed, role: str) -> str:
    sync = "'ANY 1 (*)'" if bed.pg_sync else "''"
    return (
        "\n# cryptd test bed\n"
        f"listen_addresses = '{bed.node(role).address}'\n"
        f"port = {PG_PORT}\n"
        f"unix_socket_directories = '{bed.directory(role)}'\n"
        "wal_level = replica\nmax_wal_senders = 8\nhot_standby = on\nwal_keep_size = '64MB'\n"
        "synchronous_commit = on\n"
        f"synchronous_standby_names = {sync}\n"
        "fsync = on\nshared_buffers = '32MB'\nmax_connections = 100\n"
    )


def pg_primary_up(bed: Bed, role: str) -> None:
    directory = bed.directory(role)
    data = directory / "data"
    directory.mkdir(parents=True, exist_ok=True)
    shutil.chown(directory, "postgres", "postgres")
    run(
        as_postgres(
            [pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
        ),
        timeout=120,
    )
    with open(data / "postgresql.conf", "a") as conf:
        conf.write(_pg_settings(bed, role))
    with open(data / "pg_hba.conf", "a") as hba:
        hba.write(
            f"host all all {bed.subnet}.0/24 trust\nhost replication all {bed.subnet}.0/24 trust\n"
        )
    pg_start(bed, role)


def pg_standby_up(bed: Bed, role: str, primary: str) -> None:
    """A streaming standby of ``primary`` (pg_basebackup -R), made afresh."""
    directory = bed.directory(role)
    data = directory / "data"
    if data.exists():
        shutil.rmtree(data)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.chown(directory, "postgres", "postgres")
    argv = [
        pg_bin("pg_basebackup"),
        "-h", bed.node(primary).address, "-p", str(PG_PORT), "-U", "postgres",
        "-D", str(data), "-R", "-X", "stream", "--checkpoint=fast",
    ]  # fmt: skip
    run(bed.node(role).command(as_postgres(argv)), timeout=120)
    with open(data / "postgresql.conf", "a") as conf:
        conf.write(_pg_settings(bed, role))
    # The standby's application_name names it in pg_stat_replication.
    with open(data / "postgresql.auto.conf", "a") as auto:
        auto.write(
            f"primary_conninfo = 'host={bed.node(primary).address} port={PG_PORT} "
            f"user=postgres application_name={role}'\n"
        )
    pg_start(bed, role)

    def streaming() -> bool:
        with pg_connect(bed, primary) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            ).fetchone()
            return row is not None and row[0] > 0

    wait_for(f"{role} streaming from {primary}", streaming)


def pg_set_sync(bed: Bed, primary: str, names: str) -> None:
    with pg_connect(bed, primary) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        conn.execute("SELECT pg_reload_conf()")


# Redis ----------------------------------------------------------------------------------


def redis_client(bed: Bed, role: str) -> redis.Redis:
    port = SENTINEL_PORT if role.startswith("sentinel") else REDIS_PORT
    return redis.Redis(
        host=bed.node(role).address, port=port, socket_timeout=2, socket_connect_timeout=2
    )


def redis_start(bed: Bed, role: str, primary: str | None) -> None:
    """Redis on ``role``, a replica of ``primary`` when given. Nothing on disk (as cryptd's
    replay store runs here): a restarted node comes back empty."""
    directory = bed.directory(role)
    directory.mkdir(parents=True, exist_ok=True)
    argv = [
        "redis-server", "--bind", bed.node(role).address, "--port", str(REDIS_PORT),
        "--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(directory),
        "--daemonize", "no",
    ]  # fmt: skip
    if primary is not None:
        argv += ["--replicaof", bed.node(primary).address, str(REDIS_PORT)]
    spawn(bed.node(role), argv, directory / "redis.log")
    wait_for(
        f"redis on {role}", lambda: redis_client(bed, role).ping(), log=directory / "redis.log"
    )


def sentinel_start(bed: Bed, role: str) -> None:
    directory = bed.directory(role)
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "sentinel.conf"  # Sentinel rewrites it with what it learns
    conf.write_text(
        f"bind {bed.node(role).address}\nport {SENTINEL_PORT}\nprotected-mode no\n"
        f"dir {directory}\n"
        f"sentinel monitor {REDIS_SERVICE} {bed.node('redis1').address} {REDIS_PORT} 2\n"
        f"sentinel down-after-milliseconds {REDIS_SERVICE} {bed.sentinel_down_after_ms}\n"
        f"sentinel failover-timeout {REDIS_SERVICE} 5000\n"
        f"sentinel parallel-syncs {REDIS_SERVICE} 1\n"
    )
    spawn(bed.node(role), ["redis-server", str(conf), "--sentinel"], directory / "sentinel.log")
    wait_for(f"sentinel on {role}", lambda: redis_client(bed, role).ping())


def redis_primary(bed: Bed) -> str | None:
    """The Redis machine the Sentinels' majority name as primary now."""
    votes: dict[str, int] = {}
    by_address = {bed.node(r).address: r for r in REDISES}
    for sentinel in SENTINELS:
        with contextlib.suppress(redis.RedisError):
            answer = redis_client(bed, sentinel).execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", REDIS_SERVICE
            )
            if answer:
                role = by_address.get(answer[0].decode())
                if role:
                    votes[role] = votes.get(role, 0) + 1
    best = max(votes.items(), key=lambda kv: kv[1], default=None)
    return best[0] if best and best[1] >= 2 else None


# cryptd ---------------------------------------------------------------------------------


def prepare_cryptd(bed: Bed) -> None:
    """Master key, clients file and credential; the key store's schema and empty keyring."""
    secrets_dir = bed.run_dir / "secrets"
    secrets_dir.mkdir(mode=0o700, exist_ok=True)
    master = secrets_dir / "master.key"
    master.write_bytes(base64.b64encode(secrets.token_bytes(32)) + b"\n")
    master.chmod(0o600)
    secret = generate_secret()
    clients = {
        "clients": {
            CLIENT_ID: {
                "secret": secret,
                "admin": True,
                "allow": [{"keys": "*", "operations": ["*"]}],
            }
        }
    }
    write_document(secrets_dir / "clients.json", clients)
    credential = {"url": bed.url, "client_id": CLIENT_ID, "secret": secret}
    bed.credential.write_text(json.dumps(credential, indent=2) + "\n")
    bed.credential.chmod(0o600)
    (bed.run_dir / "shim").mkdir(exist_ok=True)
    (bed.run_dir / "shim" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, **cryptd_env(bed)}
    subprocess.run(
        [bed.python, "-m", "service", "keystore", "init"],
        env=env, check=True, capture_output=True, timeout=60,
    )  # fmt: skip


def cryptd_env(bed: Bed) -> dict[str, str]:
    secrets_dir = bed.run_dir / "secrets"
    env = {
        "CRYPTD_ENV": "production",
        "CRYPTD_MASTER_KEY_FILE": str(secrets_dir / "master.key"),
        "CRYPTD_CLIENTS_FILE": str(secrets_dir / "clients.json"),
        "CRYPTD_KEYSTORE_URL": bed.keystore_url(),
        "CRYPTD_REDIS_URL": bed.redis_url(),
    }
    if bed.max_skew is not None:
        env["CRYPTD_SIGNATURE_MAX_SKEW"] = str(bed.max_skew)
    return env


def cryptd_start(bed: Bed, app: str) -> None:
    directory = bed.directory(app)
    var = bed.disk(app)
    var.mkdir(parents=True, exist_ok=True)
    if var.resolve() not in mounts_under(var):
        run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={HOST_DISK},mode=0700",
                f"{bed.prefix}-{app}",
                str(var),
            ]
        )
    for sub in ("run", "metrics", "tmp"):
        path = var / sub
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(mode=0o700)
    clock = bed.faketime_file(app)
    if not clock.exists():
        clock.write_text("+0\n")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(directory),
        **cryptd_env(bed),
        "CRYPTD_HOST": bed.node(app).address,
        "CRYPTD_PORT": str(CRYPTD_PORT),
        "CRYPTD_WORKERS": str(bed.workers),
        "CRYPTD_TLS": "off",  # HAProxy in front; the bed's bridge is private
        "CRYPTD_AUDIT_LOG": str(var / "audit.log"),
        "CRYPTD_RUNTIME_DIR": str(var / "run"),
        "PROMETHEUS_MULTIPROC_DIR": str(var / "metrics"),
        "TMPDIR": str(var / "tmp"),
        "PYTHONPATH": str(bed.run_dir / "shim"),
        "LD_PRELOAD": faketime_lib(),
        "FAKETIME_TIMESTAMP_FILE": str(clock),
        "FAKETIME_CACHE_DURATION": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_DONT_RESET": "1",
    }
    log = directory / "cryptd.log"
    spawn(bed.node(app), [bed.python, "-m", "service", "serve"], log, env)
    wait_for(f"cryptd on {app}", lambda: host_ready(bed, app), log=log)


def host_ready(bed: Bed, app: str) -> bool:
    return httpx.get(bed.host_url(app) + "/readyz", timeout=2).status_code == 200


# HAProxy --------------------------------------------------------------------------------


def haproxy_start(bed: Bed) -> None:
    directory = bed.directory("lb")
    directory.mkdir(parents=True, exist_ok=True)
    servers = "\n".join(
        f"  server {app} {bed.node(app).address}:{CRYPTD_PORT} check" for app in APPS
    )
    conf = directory / "haproxy.cfg"
    conf.write_text(
        "global\n"
        f"  stats socket {directory}/admin.sock mode 600 level admin\n"
        "  maxconn 4000\n"
        "  log stdout format raw local0\n"
        "defaults\n"
        "  mode http\n"
        # Sessions that ended abnormally (an error status, a connection cut), with the state
        # they ended in (SH: the server closed, sD: server-side timeout, ...): a 5xx the
        # balancer answered is explained in haproxy.log (lb_errors).
        "  log global\n  option httplog\n  option dontlog-normal\n"
        "  timeout connect 1s\n  timeout client 30s\n  timeout server 30s\n"
        # A request that never reached a host goes to another (it was never accepted: no replay).
        "  retries 2\n  option redispatch\n  retry-on conn-failure\n"
        "frontend cryptd\n"
        f"  bind {bed.node('lb').address}:{CRYPTD_PORT}\n"
        "  default_backend hosts\n"
        "backend hosts\n"
        # With every host out (a Redis failover's refusal window makes all /readyz fail at
        # once), HAProxy answers itself: a 503 with Retry-After, as cryptd's own 503s carry.
        "  http-error status 503 content-type application/json hdr retry-after 1 string "
        '\'{"error":{"code":"unavailable","message":"no cryptd host is ready"}}\'\n'
        "  balance roundrobin\n"
        "  option httpchk GET /readyz\n"
        "  http-check expect status 200\n"
        # A host that is down (a Redis failover's window) is checked every 100 ms: it is back
        # in the balancer 0.1-0.2 s after its readiness passes again, not 0.5-1 s.
        # A host cut off from the network answers nothing: the requests in flight to it
        # would wait for `timeout server` (or the client's own timeout). Closing them when
        # the checks take the host out makes them fail fast; the client sends a crypto call
        # again (signed afresh) and another host serves it.
        "  default-server inter 500ms fastinter 100ms downinter 100ms fall 2 rise 2"
        " on-marked-down shutdown-sessions\n"
        f"{servers}\n"
    )
    run(["haproxy", "-c", "-q", "-f", str(conf)])
    spawn(bed.node("lb"), ["haproxy", "-W", "-db", "-f", str(conf)], directory / "haproxy.log")

    def all_up() -> bool:
        return sum(1 for s in lb_servers(bed).values() if s == "UP") == len(APPS)

    wait_for("haproxy with every host up", all_up, log=directory / "haproxy.log")


def lb_errors(bed: Bed, statuses: Container[int]) -> list[str]:
    """HAProxy's log lines of the sessions answered with one of ``statuses`` (httplog)."""
    path = bed.directory("lb") / "haproxy.log"
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        # httplog: ... frontend backend/server Tq/Tw/Tc/Tr/Ta status bytes ...
        match = re.search(r" \S+/\S+ -?\d+/-?\d+/-?\d+/-?\d+/-?\d+ (\d{3}) ", line)
        if match and int(match.group(1)) in statuses:
            found.append(line)
    return found


def lb_servers(bed: Bed) -> dict[str, str]:
    """HAProxy's view: each cryptd host's status (UP, DOWN, ...)."""
    sock = bed.directory("lb") / "admin.sock"
    text = _stat(sock)
    status: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 17 and fields[0] == "hosts" and fields[1] in APPS:
            status[fields[1]] = fields[17]
    return status


def _stat(sock: Path) -> str:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(2)
        conn.connect(str(sock))
        conn.sendall(b"show stat\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
