"""``cryptd serve [--dev]``: run the service under uvicorn (uvloop, httptools)."""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
from pydantic import ValidationError

from service.auth.clients import generate_secret, write_document
from service.auth.replay_host import HostReplayStore
from service.auth.setup import check_redis_url
from service.cli import preflight
from service.cli.supervisor import Supervisor
from service.config import Settings, decode_master_key, settings_problems
from service.crypto.registry import KEY_TYPES
from service.edge.devcerts import ensure_dev_tls
from service.edge.protocol import EdgeLimits
from service.edge.server import STARTUP_FAILURE, EdgeConfig, EdgeServer, bind
from service.edge.tls import TLSFactory, TLSFiles
from service.fileio import atomic_write
from service.keys.admin import TargetNotEmpty, initialise, prepare
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeyStore
from service.logs import configure_logging
from service.metrics import init_multiprocess_dir
from service.stores import open_store

log = logging.getLogger("cryptd")

DEV_CLIENT_ID = "dev"
APP = "service.api.application:app_factory"
GRACEFUL_SHUTDOWN_SECONDS = 30


def prepare_dev_dir(directory: Path, url: str, ca_file: Path | None = None) -> bool:
    """Create the development state once: master key, a keyring with one key of every type,
    and an all-powerful client. The credential (``client.json``) names ``url`` and, for
    ``https://``, the CA that issued the server's certificate. Returns True when it was created
    now."""
    master_path = directory / "master.key"
    keyring_path = directory / "keyring.json"
    clients_path = directory / "clients.json"
    credential_path = directory / "client.json"
    created = not master_path.exists()
    if created:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(master_path, base64.b64encode(secrets.token_bytes(32)) + b"\n")
        secret = generate_secret()
        clients = {
            "clients": {
                DEV_CLIENT_ID: {
                    "secret": secret,
                    "admin": True,
                    "allow": [{"keys": "*", "operations": ["*"]}],
                }
            }
        }
        write_document(clients_path, clients)
    else:
        secret = orjson.loads(clients_path.read_bytes())["clients"][DEV_CLIENT_ID]["secret"]
    # The keyring: the file in the directory, or the PostgreSQL store CRYPTD_KEYSTORE_URL
    # names (its schema created here, in development only). A new one gets a key of each type.
    master = MasterKey(decode_master_key(master_path.read_text(), str(master_path)))
    store = open_store(os.environ.get("CRYPTD_KEYSTORE_URL") or None, keyring_path)
    try:
        prepare(store)
        if store.read() is None:
            _dev_keyring(store, master)
    finally:
        store.close()
    credential = {"url": url, "client_id": DEV_CLIENT_ID, "secret": secret}
    if ca_file is not None:
        credential["ca_file"] = str(ca_file)
    atomic_write(credential_path, orjson.dumps(credential, option=orjson.OPT_INDENT_2))
    os.environ.update(
        {
            "CRYPTD_ENV": "development",
            "CRYPTD_MASTER_KEY_FILE": str(master_path.resolve()),
            "CRYPTD_KEYRING_FILE": str(keyring_path.resolve()),
            "CRYPTD_CLIENTS_FILE": str(clients_path.resolve()),
        }
    )
    os.environ.pop("CRYPTD_MASTER_KEY", None)
    if created:
        print(
            f"cryptd: development state created in {directory}/ "
            f"(keys: {', '.join(KEY_TYPES)})\n"
            f"cryptd: development client id {DEV_CLIENT_ID!r}, secret {secret}\n"
            f"cryptd: (shown once; the credential is also in {credential_path})",
            file=sys.stderr,
        )
    else:
        print(
            f"cryptd: using development state in {directory}/ ({credential_path})", file=sys.stderr
        )
    return created


def _dev_keyring(store: KeyStore, master: MasterKey) -> None:
    try:
        initialise(store, master)
    except TargetNotEmpty:  # another server being started made it meanwhile
        return
    manager = KeyManager(store, master)
    manager.load()
    for type_name in KEY_TYPES:
        manager.create(type_name, type_name, deletion_allowed=True)


def _remove_keyring_leftovers(settings: Settings) -> None:
    """The temporary copies of the keyring a killed writer left behind (mode 0600 key material
    beside the file) go before any worker starts; the store's lock keeps a live writer's."""
    store = open_store(settings.keystore_url_value(), settings.keyring_file)
    try:
        removed = store.remove_leftovers()
    finally:
        store.close()
    if removed:
        log.warning("removed %d temporary keyring file(s) left by an interrupted write", removed)


def _prepare_metrics_dir(settings: Settings) -> None:
    """Several processes (server workers, pool workers) need prometheus-client's multiprocess
    mode: a directory, emptied of a previous run's files before any worker starts."""
    several = settings.workers > 1 or "process" in settings.executors.values()
    if not settings.metrics or not several:
        return
    configured = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if configured:
        directory = Path(configured)
    else:
        # A fresh private directory (mkdtemp: unique name, mode 0700), memory-backed where
        # possible, removed when the server exits.
        shm = "/dev/shm"  # noqa: S108 - mkdtemp below makes the name unpredictable
        base = shm if os.access(shm, os.W_OK) else None
        directory = Path(tempfile.mkdtemp(prefix="cryptd-metrics-", dir=base))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    init_multiprocess_dir(directory)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)


def _prepare_replay_dir(dev_directory: Path | None) -> None:
    """Without Redis the server workers share a replay store on this host
    (service/auth/replay_host.py) in ``CRYPTD_REPLAY_DIR``: the development directory's
    ``replay/`` in development, else a fresh private directory, memory-backed where possible
    and removed at exit (a new store, so it refuses what was signed before it started)."""
    if os.environ.get("CRYPTD_REDIS_URL") or os.environ.get("CRYPTD_REPLAY_DIR"):
        return
    if dev_directory is not None:
        directory = dev_directory / "replay"
    else:
        shm = "/dev/shm"  # noqa: S108 - mkdtemp below makes the name unpredictable
        base = shm if os.access(shm, os.W_OK) else None
        directory = Path(tempfile.mkdtemp(prefix="cryptd-replay-", dir=base))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["CRYPTD_REPLAY_DIR"] = str(directory.resolve())


def _prepare_runtime_dir() -> None:
    """The server workers of this host share a private directory (CRYPTD_RUNTIME_DIR) for what
    they keep in common without a server: the keyring generation board
    (service/keys/board.py). A fresh one per start, memory-backed where possible, removed at
    exit: a restart begins from what the store holds."""
    if os.environ.get("CRYPTD_RUNTIME_DIR"):
        return
    shm = "/dev/shm"  # noqa: S108 - mkdtemp below makes the name unpredictable
    base = shm if os.access(shm, os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix="cryptd-run-", dir=base))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["CRYPTD_RUNTIME_DIR"] = str(directory)


def _open_replay_store(settings: Settings, dev_created: bool) -> None:
    """Open the host store once before any worker does: a directory that is not private
    fails here with its reason. A store created together with the development clients
    needs no start-up window (nothing signed by them can have been accepted before)."""
    if settings.redis_url or settings.replay_dir is None:
        return
    store = HostReplayStore(
        settings.replay_dir,
        max_age=settings.signature_max_age,
        max_skew=settings.signature_max_skew,
        max_bytes=settings.replay_max_bytes,
        epoch=0 if dev_created else None,
    )
    store.close()


def _docs_problem(settings: Settings) -> str | None:
    """CRYPTD_DOCS=true needs the docs extra: one error line here rather than the app
    factory's traceback in every worker."""
    if settings.docs is not True:
        return None
    from service.api.docs import DocsUnavailable, assets_directory

    try:
        assets_directory()
    except DocsUnavailable as exc:
        return f"CRYPTD_DOCS=true: {exc}"
    return None


def _refuse(problems: list[str]) -> int:
    """Print every problem of the configuration, one a line; the exit status."""
    if len(problems) > 1:
        print(f"cryptd: the configuration has {len(problems)} problems:", file=sys.stderr)
    for problem in problems:
        print(f"cryptd: error: {problem}", file=sys.stderr)
    return 2


def _summary(start: dict[str, Any]) -> str:
    """The start line's fields for a person: ``mode production, workers 2, tls on, ...``."""
    return ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in start.items())


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def serve(args: argparse.Namespace) -> int:
    if args.host:
        os.environ["CRYPTD_HOST"] = args.host
    if args.port:
        os.environ["CRYPTD_PORT"] = str(args.port)
    if args.workers:
        os.environ["CRYPTD_WORKERS"] = str(args.workers)
    if args.tls and not args.dev:
        os.environ["CRYPTD_TLS"] = "on"
    dev_directory, dev_created = None, False
    if args.dev:
        host = os.environ.get("CRYPTD_HOST", "127.0.0.1")
        port = os.environ.get("CRYPTD_PORT", "8080")
        directory = dev_directory = Path(os.environ.get("CRYPTD_DEV_DIR", ".cryptd-dev"))
        ca_file = None
        if args.tls:
            names = [socket.gethostname()] if host in ("0.0.0.0", "::", "") else [host]
            dev_tls = ensure_dev_tls(directory, names)
            os.environ["CRYPTD_TLS_CERT_FILE"] = str(dev_tls.cert_file)
            os.environ["CRYPTD_TLS_KEY_FILE"] = str(dev_tls.key_file)
            ca_file = dev_tls.ca_file
        scheme = "https" if args.tls else "http"
        dev_created = prepare_dev_dir(directory, f"{scheme}://{host}:{port}", ca_file)
    _prepare_replay_dir(dev_directory)
    _prepare_runtime_dir()
    # Validate now, so a bad configuration fails here with all its problems at once, not in
    # every worker with the first one.
    try:
        settings = Settings()
    except ValidationError as exc:
        return _refuse(settings_problems(exc))
    report = preflight.check(settings, reach_redis=args.check)
    if settings.redis_url:
        try:
            check_redis_url(settings.redis_url)
        except ValueError as exc:
            report.problems.append(str(exc))
    docs_problem = _docs_problem(settings)
    if docs_problem:
        report.problems.append(docs_problem)
    if not report.problems:
        try:
            _open_replay_store(settings, dev_created)
        except (ValueError, OSError) as exc:
            report.problems.append(f"CRYPTD_REPLAY_DIR {settings.replay_dir}: {exc}")
    if report.problems:
        return _refuse(report.problems)
    if args.check:
        print(f"cryptd: configuration OK: {_summary(report.start)}", file=sys.stderr)
        return 0
    # Every worker sees the count the supervisor starts (and sizes its pool by it).
    os.environ["CRYPTD_WORKERS"] = str(settings.workers)
    _prepare_metrics_dir(settings)
    configure_logging(settings.log_level, settings.access_log, "off")
    log.info("cryptd starting", extra=report.start)
    _remove_keyring_leftovers(settings)
    if settings.tls == "off":
        log.warning(
            "TLS is off (CRYPTD_TLS=off): requests, plaintexts and data keys cross the network "
            "in the clear unless a proxy or mesh sidecar in front of cryptd encrypts them"
        )
    options: dict[str, Any] = {
        "factory": True,
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "lifespan": "on",
        "access_log": False,  # cryptd's own access log: one JSON line per request, when enabled
        "log_config": None,  # uvicorn's loggers go through cryptd's JSON handler
        "log_level": settings.log_level,
        "server_header": False,
        # Clients connect directly (a Kubernetes Service does not proxy HTTP): no
        # X-Forwarded-For to trust, and one ASGI layer less per request.
        "proxy_headers": False,
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_SECONDS,
        "timeout_keep_alive": settings.keepalive_timeout,
    }
    # uvicorn's httptools protocol with cryptd's edge rules (service/edge/).
    edge = EdgeLimits(
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_read_timeout,
        request_timeout=settings.request_read_timeout,
    )
    cert_file, key_file = settings.tls_cert_file, settings.tls_key_file
    if cert_file is not None and key_file is not None:
        # Each worker builds its contexts from the files (and watches them); checked above.
        files = TLSFiles(cert_file, key_file, settings.tls_client_ca_file, settings.tls_client_cert)
        options["ssl_context_factory"] = TLSFactory(files)
    config = EdgeConfig(APP, edge=edge, **options)
    if settings.workers > 1:
        # One listening socket per worker: see service/cli/supervisor.py.
        # Each worker installs the same logging first thing, as this process did above.
        setup = functools.partial(configure_logging, settings.log_level, settings.access_log, "off")
        return Supervisor(
            config, settings.workers, grace=GRACEFUL_SHUTDOWN_SECONDS + 5, setup=setup
        ).run()
    sock = bind(settings.host, settings.port)
    # uvicorn re-raises the SIGTERM it handled once the drain is over; a clean drain is a clean
    # exit, so that re-raise ends the process with status 0 instead of 143.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server = EdgeServer(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    return 0 if server.started else STARTUP_FAILURE


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("serve", help="run the service")
    parser.add_argument("--dev", action="store_true", help="development mode with local state")
    parser.add_argument("--host", help="bind address (default $CRYPTD_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default $CRYPTD_PORT or 8080)")
    parser.add_argument(
        "--workers", type=int, help="server worker processes (default: one per CPU available)"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="HTTPS; with --dev, a development CA and server certificate in the dev directory "
        "(client.json gets an https:// URL and ca_file); without, CRYPTD_TLS=on",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the configuration (settings, master key, TLS files, clients file, key "
        "store, Redis) without serving: every problem at once; exit status 0 when it would "
        "start, 2 when not",
    )
    parser.set_defaults(func=serve)
