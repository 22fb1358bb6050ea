"""Shared pieces for the authentication and client tests (no tests here).

- ``Server``: a real uvicorn server in a thread on a free loopback port.
- ``make_app``: a small Starlette app behind ``SignatureAuthMiddleware`` with routes shaped like
  the contract's (fake "crypto" so the client can be tested end to end).
- ``make_app_from_env``: the same app for ``uvicorn --factory`` in a separate process.
- ``RedisServer``: a private redis-server on a free port that tests may stop and restart.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import uvicorn
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from service.asgi import ASGIApp
from service.auth.clients import ClientsFile, generate_secret
from service.auth.middleware import SignatureAuthMiddleware
from service.auth.policy import authorize, client_from_scope, require_admin
from service.auth.ratelimit import MemoryRateLimiter, RateLimiter
from service.auth.redis_client import close, connect
from service.auth.replay import (
    KEY_PREFIX,
    SEED_SCRIPT,
    MemoryReplayStore,
    RedisReplayStore,
    ReplayStore,
)
from service.auth.signature import DEFAULT_MAX_SKEW
from service.errors import (
    Conflict,
    CryptdError,
    DecryptionFailed,
    InvalidRequest,
    KeyNotFound,
)

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"

_STATUS = {
    "invalid_request": 400,
    "decryption_failed": 400,
    "unauthenticated": 401,
    "forbidden": 403,
    "key_not_found": 404,
    "conflict": 409,
    "rate_limited": 429,
    "overloaded": 503,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_reachable(url: str = SHARED_REDIS_URL) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def require_redis(url: str = SHARED_REDIS_URL) -> None:
    """Skip when Redis is unreachable, except under CI=true where that is a failure."""
    if redis_reachable(url):
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Redis at {url} is unreachable (CI=true: tests must not skip)")
    pytest.skip(f"Redis at {url} is unreachable")


# --------------------------------------------------------------------------------------------
# Clients file


def write_clients(path: Path, clients: dict[str, dict[str, Any]]) -> None:
    path.write_text(json.dumps({"clients": clients}))
    path.chmod(0o600)


def standard_clients(path: Path) -> dict[str, str]:
    """Write a clients file with an application, a restricted and an admin client;
    return their secrets by id."""
    secrets = {name: generate_secret() for name in ("app", "limited", "admin")}
    write_clients(
        path,
        {
            "app": {"secret": secrets["app"], "allow": [{"keys": "*", "operations": ["*"]}]},
            "limited": {
                "secret": secrets["limited"],
                "allow": [{"keys": "orders-*", "operations": ["encrypt"]}],
            },
            "admin": {
                "secret": secrets["admin"],
                "admin": True,
                "allow": [{"keys": "*", "operations": ["*"]}],
            },
        },
    )
    return secrets


# --------------------------------------------------------------------------------------------
# The application


def _fake_token(key: str, version: int, plaintext: bytes, aad: bytes) -> str:
    blob = json.dumps(
        {"k": key, "a": base64.b64encode(aad).decode(), "p": base64.b64encode(plaintext).decode()}
    ).encode()
    return f"cryptd:v{version}:" + base64.urlsafe_b64encode(blob).decode().rstrip("=")


def _fake_untoken(key: str, token: str, aad: bytes) -> tuple[int, bytes]:
    try:
        prefix, version, data = token.split(":", 2)
        blob = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
        if prefix != "cryptd" or blob["k"] != key or base64.b64decode(blob["a"]) != aad:
            raise ValueError
        return int(version[1:]), base64.b64decode(blob["p"])
    except (ValueError, KeyError):
        raise DecryptionFailed() from None


class FakeService:
    """Just enough of the API to exercise the client and the policy checks."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, Any]] = {}
        self.retry_counts: dict[str, int] = {}
        self.arrivals: dict[str, list[float]] = {}

    def _key(self, name: str) -> dict[str, Any]:
        if name not in self.keys:
            raise KeyNotFound()
        return self.keys[name]

    def _meta(self, name: str) -> dict[str, Any]:
        key = self.keys[name]
        return {
            "name": name,
            "type": key["type"],
            "latest_version": key["latest"],
            "min_decryption_version": key["min"],
            "deletion_allowed": key["deletion_allowed"],
            "versions": [
                {"version": v, "created_at": "2024-01-01T00:00:00Z"}
                for v in range(1, key["latest"] + 1)
            ],
        }

    def crypto(self, op: str, name: str, item: dict[str, Any]) -> dict[str, Any]:
        key = self._key(name)
        aad = base64.b64decode(item.get("aad", ""))
        if op == "encrypt":
            plaintext = base64.b64decode(item["plaintext"], validate=True)
            version = item.get("key_version", key["latest"])
            return {
                "ciphertext": _fake_token(name, version, plaintext, aad),
                "key_version": version,
            }
        if op == "decrypt":
            version, plaintext = _fake_untoken(name, item["ciphertext"], aad)
            return {"plaintext": base64.b64encode(plaintext).decode(), "key_version": version}
        if op in ("sign", "verify"):
            data = item.get("message") or item.get("digest")
            if data is None:
                raise InvalidRequest("message or digest is required")
            mac = hashlib.sha256(name.encode() + base64.b64decode(data)).digest()
            if op == "sign":
                return {"signature": base64.b64encode(mac).decode(), "key_version": key["latest"]}
            return {"valid": base64.b64decode(item["signature"]) == mac}
        if op == "rewrap":
            _, plaintext = _fake_untoken(name, item["ciphertext"], aad)
            target = item.get("to_key", name)
            version = self._key(target)["latest"]
            return {
                "ciphertext": _fake_token(target, version, plaintext, aad),
                "key_version": version,
            }
        raise InvalidRequest()

    async def operation(self, request: Request) -> Response:
        client = client_from_scope(request.scope)
        op, name = request.path_params["op"], request.path_params["key"]
        authorize(client, name, op)
        self.arrivals.setdefault(name, []).append(time.monotonic())
        # Keys named retry-<status>-<n>-<seconds> answer <status> n times, then work.
        if name.startswith("retry-"):
            _, status, count, seconds = name.split("-")
            seen = self.retry_counts.get(name, 0)
            self.retry_counts[name] = seen + 1
            if seen < int(count):
                code = "rate_limited" if status == "429" else "overloaded"
                return JSONResponse(
                    {"error": {"code": code, "message": "try later"}},
                    status_code=int(status),
                    headers={"Retry-After": seconds},
                )
            return JSONResponse({"ciphertext": "cryptd:v1:AA", "key_version": 1})
        body = await request.json()
        if op == "datakey":
            key = self._key(name)
            data_key = os.urandom(body.get("bits", 256) // 8)
            return JSONResponse(
                {
                    "plaintext": base64.b64encode(data_key).decode(),
                    "ciphertext": _fake_token(name, key["latest"], data_key, b""),
                    "key_version": key["latest"],
                }
            )
        if "batch" in body:
            results: list[dict[str, Any]] = []
            for item in body["batch"]:
                try:
                    results.append(self.crypto(op, name, item))
                except CryptdError as exc:
                    results.append({"error": {"code": exc.code, "message": exc.message}})
            return JSONResponse({"batch": results})
        return JSONResponse(self.crypto(op, name, body))

    async def echo(self, request: Request) -> Response:
        client = client_from_scope(request.scope)
        authorize(client, request.path_params["key"], "encrypt")
        body = await request.body()
        return JSONResponse(
            {"client": client.client_id, "body": body.decode(), "query": request.url.query}
        )

    async def list_keys(self, request: Request) -> Response:
        client = client_from_scope(request.scope)
        names = [n for n in sorted(self.keys) if client.admin or client.allows(n, "read")]
        return JSONResponse({"keys": [self._meta(n) for n in names]})

    async def key(self, request: Request) -> Response:
        client = client_from_scope(request.scope)
        name = request.path_params["key"]
        if request.method == "GET":
            authorize(client, name, "read")
            self._key(name)
            return JSONResponse(self._meta(name))
        require_admin(client)
        if request.method == "POST":
            if name in self.keys:
                raise Conflict("key exists")
            body = await request.json()
            self.keys[name] = {
                "type": body["type"],
                "latest": 1,
                "min": 1,
                "deletion_allowed": body.get("deletion_allowed", False),
            }
            return JSONResponse(self._meta(name), status_code=201)
        key = self._key(name)
        if request.method == "PATCH":
            body = await request.json()
            key["min"] = body.get("min_decryption_version", key["min"])
            key["deletion_allowed"] = body.get("deletion_allowed", key["deletion_allowed"])
            return JSONResponse(self._meta(name))
        if not key["deletion_allowed"]:
            raise Conflict("deletion not allowed")
        del self.keys[name]
        return Response(status_code=204)

    async def rotate(self, request: Request) -> Response:
        require_admin(client_from_scope(request.scope))
        name = request.path_params["key"]
        self._key(name)["latest"] += 1
        return JSONResponse(self._meta(name))


async def _error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, CryptdError)
    return JSONResponse(
        {"error": {"code": exc.code, "message": exc.message}},
        status_code=_STATUS.get(exc.code, 500),
        headers={"X-Request-ID": request.headers.get("x-request-id", "")},
    )


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def make_app(
    clients_file: Path,
    *,
    replay: ReplayStore | None = None,
    rate_limiter: RateLimiter | None = None,
    max_age: int = 300,
    max_skew: int = DEFAULT_MAX_SKEW,
    fail_open: bool = False,
    failures: list[str] | None = None,
    rejections: list[str] | None = None,
    service: FakeService | None = None,
    redis_client: Redis | None = None,
) -> ASGIApp:
    """The app; ``redis_client`` (used by ``replay``) is closed at shutdown."""
    service = service or FakeService()
    routes = [
        Route("/healthz", _healthz),
        Route("/v1/echo/{key}", service.echo, methods=["POST", "GET"]),
        Route("/v1/keys", service.list_keys),
        Route("/v1/keys/{key}", service.key, methods=["GET", "POST", "PATCH", "DELETE"]),
        Route("/v1/keys/{key}/rotate", service.rotate, methods=["POST"]),
        Route("/v1/{op}/{key}", service.operation, methods=["POST"]),
    ]

    replay_store = replay if replay is not None else MemoryReplayStore()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        # Closed inside the server's own event loop.
        await replay_store.aclose()
        if rate_limiter is not None:
            await rate_limiter.aclose()
        if redis_client is not None:
            await close(redis_client)

    inner = Starlette(
        routes=routes, exception_handlers={CryptdError: _error_handler}, lifespan=lifespan
    )
    return SignatureAuthMiddleware(
        inner,
        registry_provider=ClientsFile(clients_file, interval=0.05),
        replay=replay_store,
        rate_limiter=rate_limiter,
        max_age=max_age,
        max_skew=max_skew,
        fail_open=fail_open,
        on_failure=None if failures is None else failures.append,
        on_rejection=None if rejections is None else rejections.append,
    )


def make_app_from_env() -> ASGIApp:
    """For ``uvicorn --factory``: clients file and Redis URL from the environment."""
    redis_url = os.environ.get("CRYPTD_TEST_REDIS_URL")
    client = connect(redis_url) if redis_url else None
    rate = float(os.environ.get("CRYPTD_TEST_RATE", "0"))
    return make_app(
        Path(os.environ["CRYPTD_TEST_CLIENTS_FILE"]),
        replay=RedisReplayStore(client) if client else None,
        rate_limiter=MemoryRateLimiter(rate) if rate else None,
        redis_client=client,
    )


# --------------------------------------------------------------------------------------------
# Servers


class Server:
    """uvicorn serving ``app`` from a thread, on a free loopback port."""

    def __init__(self, app: ASGIApp, *, access_log: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            lifespan="on",
            log_config=None,  # leave logging to the test (caplog)
            access_log=access_log,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> Server:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@contextlib.contextmanager
def server_process(env: dict[str, str]) -> Iterator[str]:
    """The test app in a separate uvicorn process; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "--app-dir",
            str(Path(__file__).parent.parent),
            "tests.test_auth_support:make_app_from_env",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env={**os.environ, **env, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _port_open(port), proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("process did not become ready")
        time.sleep(0.05)


class RedisServer:
    """A private redis-server (no persistence) on a free port; stop() and start() at will.

    Its first start sets the replay store's epoch to 0 (a brand-new server has lost nothing,
    so requests are accepted at once); a restart leaves it unset, as a real restart does."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        proc = self._proc
        _wait_for(lambda: redis_reachable(self.url), proc)
        if not self._started:
            with redis.Redis.from_url(self.url) as client:
                client.eval(SEED_SCRIPT, 2, f"{KEY_PREFIX}epoch", f"{KEY_PREFIX}primary", 0)
        self._started = True

    def kill(self) -> None:
        """SIGKILL: no shutdown, every nonce gone."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(redis.RedisError), redis.Redis.from_url(self.url) as client:
            client.shutdown(nosave=True)
        self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        self._proc = None
