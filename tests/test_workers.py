"""Every core by default, one replay store for all workers: ``cryptd serve`` starts one worker
per CPU it may use, a replay sent to each of N workers is refused N - 1 times (host store and
Redis), and a configuration whose workers would not share a store is refused. Real servers."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import pydantic
import pytest

from service.auth.signature import sign_request
from service.config import Settings
from service.cpus import available_cpus
from tests.conftest import (
    REDIS_URL,
    Server,
    connections_to_every_worker,
    free_port,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow  # live servers of several workers


def _replay_to_each(server: Server, workers: int) -> list[int]:
    """The same signed request, sent once to every worker; the statuses, in worker order."""
    body = orjson.dumps({"plaintext": "aGVsbG8="})
    path = "/v1/encrypt/aes256-gcm"
    headers = sign_request("POST", path, "", body, server.client_id, server.secret)
    with connections_to_every_worker(server, workers) as clients:
        return [
            clients[index].post(path, content=body, headers=headers).status_code
            for index in sorted(clients)
        ]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_a_replay_sent_to_each_worker_is_refused_by_all_but_one(
    tmp_path: Path, workers: int
) -> None:
    server = start_server(tmp_path, workers=workers)  # no Redis: the host-local store
    try:
        readiness = httpx.get(server.url + "/readyz").json()["checks"]["replay_store"]
        assert readiness == {"ok": True, "backend": "host"}
        for _ in range(3):
            statuses = _replay_to_each(server, workers)
            assert sorted(statuses) == [200] + [401] * (workers - 1), statuses
    finally:
        stop_server(server)


@pytest.mark.slow
def test_with_redis_a_replay_is_refused_by_every_other_worker(
    tmp_path: Path, redis_url: str
) -> None:
    server = start_server(tmp_path, {"CRYPTD_REDIS_URL": redis_url}, workers=2)
    try:
        readiness = httpx.get(server.url + "/readyz").json()["checks"]["replay_store"]
        assert readiness == {"ok": True, "backend": "redis"}
        statuses = _replay_to_each(server, 2)
        assert sorted(statuses) == [200, 401], statuses
    finally:
        stop_server(server)


def _serve_without_worker_setting(
    directory: Path, pin: set[int] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``cryptd serve --dev`` as the README runs it: no CRYPTD_WORKERS, no Redis."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CRYPTD_WORKERS", "CRYPTD_REDIS_URL", "CRYPTD_REPLAY_DIR")
    }
    env["CRYPTD_DEV_DIR"] = str(directory / "dev")
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    log = open(directory / "server.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--dev", "--port", str(port)],
        cwd=directory,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert process.poll() is None, (directory / "server.log").read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return process, url
        assert time.monotonic() < deadline, (directory / "server.log").read_text()[-3000:]
        time.sleep(0.2)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=40)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_serve_runs_one_worker_per_available_cpu_by_default(tmp_path: Path) -> None:
    process, url = _serve_without_worker_setting(tmp_path / "all")
    try:
        detail = httpx.get(url + "/readyz").json()["checks"]
        assert detail["server"]["workers"] == available_cpus()
        assert detail["replay_store"]["backend"] == "host"
        assert (tmp_path / "all/dev/replay/cryptd-replay").is_dir()
    finally:
        _stop(process)
    assert process.returncode == 0


@pytest.mark.slow
def test_a_process_pinned_to_one_cpu_runs_one_worker(tmp_path: Path) -> None:
    if available_cpus() < 2:
        pytest.skip("one CPU only: nothing to restrict")
    process, url = _serve_without_worker_setting(
        tmp_path / "one", pin={min(os.sched_getaffinity(0))}
    )
    try:
        detail = httpx.get(url + "/readyz").json()["checks"]
        assert detail["server"] == {"ok": True, "worker": 0, "workers": 1}
        assert detail["pool"]["thread"]["workers"] == 1  # cores / workers
    finally:
        _stop(process)


def test_several_workers_without_a_shared_store_are_refused_in_development_too() -> None:
    with pytest.raises(pydantic.ValidationError, match="needs a replay store every worker"):
        Settings(env="development", workers=2)
    assert Settings(env="development", workers=1).workers == 1
    assert Settings(env="development", workers=2, replay_dir=Path("/x")).workers == 2
    assert Settings(env="development", workers=2, redis_url=REDIS_URL).workers == 2


def test_the_default_worker_count_sizes_the_pool_to_the_cpus() -> None:
    settings = Settings(env="development", replay_dir=Path("/x"))
    cpus = available_cpus()
    assert settings.workers == cpus
    assert settings.pool_workers == max(1, cpus // settings.workers)
    assert Settings(env="development", workers=1).pool_workers == cpus
    # An app built in its own process, with no store to share: one worker, every CPU's thread.
    alone = Settings(env="development")
    assert (alone.workers, alone.pool_workers) == (1, cpus)


def test_a_replay_dir_open_to_others_stops_serve_with_its_reason(tmp_path: Path) -> None:
    store = tmp_path / "replay" / "cryptd-replay"
    store.mkdir(parents=True)
    store.chmod(0o777)
    env = {
        **os.environ,
        "CRYPTD_DEV_DIR": str(tmp_path / "dev"),
        "CRYPTD_REPLAY_DIR": str(tmp_path / "replay"),
        "CRYPTD_WORKERS": "2",
    }
    env.pop("CRYPTD_REDIS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--dev", "--port", str(free_port())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert b"is open to other users (mode 0777; it must be 0700)" in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.slow
def test_the_configured_skew_reaches_the_signature_check(tmp_path: Path) -> None:
    server = start_server(tmp_path, {"CRYPTD_SIGNATURE_MAX_SKEW": "60"})
    try:
        for ahead, status in ((50, 200), (70, 401)):
            created = int(time.time()) + ahead
            headers = sign_request(
                "GET", "/v1/keys", "", b"", server.client_id, server.secret, created=created
            )
            assert httpx.get(server.url + "/v1/keys", headers=headers).status_code == status
    finally:
        stop_server(server)


@pytest.mark.slow
def test_uvicorn_workers_share_a_replay_store(tmp_path: Path) -> None:
    """``uvicorn --factory --workers 2`` (not cryptd serve, so no store is given): the workers
    find their siblings' host store, and a replay sent over fresh connections is accepted once."""
    dev = start_server(tmp_path / "dev")  # makes the development keyring and client
    stop_server(dev)
    state = tmp_path / "dev" / "dev"
    port = free_port()
    env = {
        **os.environ,
        "CRYPTD_ENV": "development",
        "CRYPTD_MASTER_KEY_FILE": str(state / "master.key"),
        "CRYPTD_KEYRING_FILE": str(state / "keyring.json"),
        "CRYPTD_CLIENTS_FILE": str(state / "clients.json"),
    }
    for name in ("CRYPTD_WORKERS", "CRYPTD_REPLAY_DIR", "CRYPTD_REDIS_URL", "CRYPTD_DEV_DIR"):
        env.pop(name, None)
    command = [sys.executable, "-m", "uvicorn", "--factory", "service.api.application:app_factory"]
    command += ["--workers", "2", "--port", str(port), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "uvicorn.log", "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        body = orjson.dumps({"plaintext": "aGVsbG8="})
        path = "/v1/encrypt/aes256-gcm"
        deadline = time.monotonic() + 60
        while True:  # up, and past the new store's start-up window (503 until then)
            assert process.poll() is None, (tmp_path / "uvicorn.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "uvicorn.log").read_text()[-3000:]
            headers = sign_request("POST", path, "", body, dev.client_id, dev.secret)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(url + path, content=body, headers=headers).status_code == 200:
                    break
            time.sleep(0.3)
        readiness = httpx.get(url + "/readyz").json()["checks"]["replay_store"]
        assert readiness == {"ok": True, "backend": "host"}
        headers = sign_request("POST", path, "", body, dev.client_id, dev.secret)
        statuses = []
        for _ in range(30):  # fresh connections: the kernel hands them to either worker
            with httpx.Client(base_url=url) as fresh:
                statuses.append(fresh.post(path, content=body, headers=headers).status_code)
        assert sorted(statuses) == [200] + [401] * 29, statuses
    finally:
        process.terminate()
        process.wait(timeout=30)
        shared = Path(tempfile.gettempdir()) / f"cryptd-replay-{os.geteuid()}-{process.pid}"
        shutil.rmtree(shared, ignore_errors=True)
