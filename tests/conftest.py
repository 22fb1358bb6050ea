"""Shared fixtures: real cryptd servers (uvicorn subprocesses) and signed raw requests."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from service.auth.signature import sign_request

REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """A running ``cryptd serve --dev`` process and its development credential."""

    process: subprocess.Popen[bytes]
    url: str
    client_id: str
    secret: bytes
    directory: Path
    log_path: Path
    ca_file: Path | None = None  # https:// (``serve --dev --tls``): the development CA

    def verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify`` for this server: a context trusting its CA, for https://."""
        if self.ca_file is None:
            return True
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        sign: bool = True,
        client_id: str | None = None,
        secret: bytes | None = None,
        query: str = "",
        connection: httpx.Client | None = None,
    ) -> httpx.Response:
        """A signed request (unless ``sign=False``); ``raw`` sends bytes as they are.
        ``connection``: sent on that client's kept-alive connection (one worker's, see
        :func:`connections_to_every_worker`), else on a new one."""
        content = raw if raw is not None else (b"" if body is None else orjson.dumps(body))
        sent: dict[str, str] = {}
        if sign:
            sent.update(
                sign_request(
                    method,
                    path,
                    query,
                    content,
                    client_id or self.client_id,
                    secret or self.secret,
                )
            )
        sent.update(headers or {})
        target = path + (f"?{query}" if query else "")
        if connection is not None:
            return connection.request(method, target, content=content, headers=sent)
        return httpx.request(
            method,
            self.url + target,
            content=content,
            headers=sent,
            timeout=30,
            verify=self.verify(),
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    directory: Path,
    env: Mapping[str, str] | None = None,
    *,
    workers: int = 1,
    prefix: Sequence[str] = (),
    state_view: Callable[[int], Path] | None = None,
    tls: bool = False,
    ca_file: Path | None = None,
) -> Server:
    """``cryptd serve --dev`` in ``directory`` (its state in ``directory/dev`` unless ``env``
    sets ``CRYPTD_DEV_DIR``). ``prefix`` runs the server under another command (``unshare``,
    ``setpriv``); ``state_view(pid)`` is where this process sees the development state when
    the server's view differs (a private mount namespace: ``/proc/<pid>/root/...``).
    ``tls``: ``--tls``, https:// with the development CA; ``ca_file``: https:// with the
    certificate files that ``env`` names, issued by that CA."""
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "server.log"
    full_env = {
        **os.environ,
        "CRYPTD_DEV_DIR": str(directory / "dev"),
        "CRYPTD_WORKERS": str(workers),
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "service", "serve", "--dev", "--port", str(port)]
            + (["--tls"] if tls else []),
            cwd=directory,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own process group: a server that never became ready is killed with its
            # workers, not only the supervisor (the workers would outlive the test).
            start_new_session=True,
        )
    if tls:
        ca_file = Path(full_env["CRYPTD_DEV_DIR"]) / "tls" / "ca.crt"
    url = f"{'https' if ca_file else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, OSError):
            verify = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
            if httpx.get(url + "/readyz", timeout=1, verify=verify).status_code == 200:
                break
        if time.monotonic() > deadline:
            _kill_group(process)
            raise RuntimeError(f"server not ready: {log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    state = state_view(process.pid) if state_view else Path(full_env["CRYPTD_DEV_DIR"])
    credential = orjson.loads((state / "client.json").read_bytes())
    return Server(
        process,
        url,
        credential["client_id"],
        base64.b64decode(credential["secret"]),
        directory,
        log_path,
        ca_file,
    )


@contextlib.contextmanager
def connections_to_every_worker(server: Server, workers: int) -> Iterator[dict[int, httpx.Client]]:
    """One keep-alive connection to each worker: connections are opened until /readyz has
    named every worker index (the kernel spreads new connections over the workers). A client
    is for one thread at a time: httpcore's sync pool may close a connection under a request
    another thread is waiting on (tests/test_revocation.py, the storm)."""
    found: dict[int, httpx.Client] = {}
    extra: list[httpx.Client] = []
    try:
        deadline = time.monotonic() + 30
        while len(found) < workers:
            assert time.monotonic() < deadline, f"reached workers {sorted(found)} only"
            client = httpx.Client(
                base_url=server.url,
                timeout=30,
                verify=server.verify(),
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            )
            detail = client.get("/readyz").json()["checks"]["server"]
            assert detail["workers"] == workers
            if detail["worker"] in found:
                extra.append(client)  # kept open so the next connection hashes elsewhere
            else:
                found[detail["worker"]] = client
        yield found
    finally:
        for client in [*found.values(), *extra]:
            client.close()


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_group(server.process)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One shared development server for API tests that do not change its configuration."""
    running = start_server(tmp_path_factory.mktemp("server"))
    yield running
    stop_server(running)


@pytest.fixture(scope="session", autouse=True)
def _shared_redis_replay_epoch() -> None:
    """A brand-new shared Redis (CI starts one) would get its replay-store epoch from the first
    request that reaches it, and refuse requests signed in the seconds before (503, the
    restart window of docs/AUTH.md). Every test client's secret is new, so nothing of theirs
    was accepted before: epoch 0, for the Redis running now, is the truth here. An existing
    epoch is left alone."""
    import redis

    from service.auth.replay import KEY_PREFIX, SEED_SCRIPT

    with (
        contextlib.suppress(redis.RedisError),
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1) as client,
    ):
        client.eval(SEED_SCRIPT, 2, f"{KEY_PREFIX}epoch", f"{KEY_PREFIX}primary", 0)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis; skipped where none runs, but a failure under CI."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Redis at {REDIS_URL} is required under CI: {exc}")
        pytest.skip(f"Redis at {REDIS_URL} is not reachable: {exc}")
    return REDIS_URL


POSTGRES_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh database on the shared PostgreSQL (127.0.0.1:5432), dropped afterwards; its
    URL (``postgresql://...``). Skipped where no PostgreSQL runs, a failure under CI."""
    import uuid

    psycopg = pytest.importorskip("psycopg")
    try:
        admin = psycopg.connect(POSTGRES_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required under CI: {exc}")
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is not reachable: {exc}")
    name = f"cryptd_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The real PostgreSQL (trust auth, database ``test``); skipped where none runs, but a
    failure under CI. Tests never change this server: they make databases of their own."""
    import psycopg

    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=2).close()
    except psycopg.Error as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at {POSTGRES_URL} is required under CI: {exc}")
        pytest.skip(f"PostgreSQL at {POSTGRES_URL} is not reachable: {exc}")
    return POSTGRES_URL
