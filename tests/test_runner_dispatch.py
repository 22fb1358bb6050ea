"""Where work runs (the runner's "mixed" placement) and which requests take the crypto fast
path. Real keyring, real thread pool, real server; no mocks."""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from service.api.items import PARSERS
from service.api.pipeline import RequestPipeline
from service.api.routes import crypto
from service.auth.signature import sign_request
from service.config import DEFAULT_EXECUTORS, Settings
from service.crypto.base import SignOptions
from service.crypto.ed25519 import SODIUM_MAX_MESSAGE
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.operations import EncryptItem, SignItem
from service.pool import make_executor
from service.pool.lag import LoopLag
from service.pool_tasks import init_worker
from service.runner import CryptoRunner
from tests.conftest import Server, start_server, stop_server
from tests.test_token import new_manager


def _manager(tmp_path: Path) -> KeyManager:
    manager = new_manager(tmp_path)
    manager.create("signing", "rsa-2048")
    manager.create("data", "aes256-gcm")
    return manager


async def test_mixed_runs_one_item_on_the_loop_and_batches_in_the_pool(tmp_path: Path) -> None:
    threads: list[int] = []

    def observe(op: str, key_type: str, seconds: float, outcome: str, items: int) -> None:
        threads.append(threading.get_ident())

    pool = make_executor("thread", workers=1, max_pending=8, deadline=10.0)
    await pool.start()
    try:
        runner = CryptoRunner(
            _manager(tmp_path),
            {"rsa-2048": pool, "aes256-gcm": pool},
            single_inline=frozenset({"rsa-2048"}),
            chunk_size=64,
            observer=observe,
        )
        item = SignItem(b"message", False, SignOptions(algorithm="pss"), None)
        (single,) = await runner.run("sign", "signing", [item])
        assert isinstance(single, dict)
        assert single["key_version"] == 1
        assert threads == [threading.get_ident()]  # on the event loop: no hand-off

        threads.clear()
        outcomes = await runner.run("sign", "signing", [item, item])
        assert [o["key_version"] for o in outcomes if isinstance(o, dict)] == [1, 1]
        assert len(threads) == 1
        assert threads[0] != threading.get_ident()  # a pool thread

        threads.clear()  # a type not listed keeps its executor for single items too
        await runner.run("encrypt", "data", [EncryptItem(b"x", b"", None)])
        assert threads[0] != threading.get_ident()
    finally:
        await pool.close()


def test_mixed_placement_is_configurable_and_runs_batches_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CRYPTD_ENV", "development")
    monkeypatch.setenv("CRYPTD_EXECUTORS", '{"rsa-4096": "mixed", "rsa-2048": "process"}')
    settings = Settings()
    assert settings.executors["rsa-4096"] == "mixed"
    assert settings.executor_kind("rsa-4096") == "thread"
    assert settings.executor_kind("rsa-2048") == "process"
    assert settings.single_items_inline() == frozenset(
        {"rsa-4096"} | {name for name, where in DEFAULT_EXECUTORS.items() if where == "mixed"}
    ) - {"rsa-2048"}
    monkeypatch.setenv("CRYPTD_EXECUTORS", '{"rsa-2048": "fiber"}')
    with pytest.raises(ValueError, match="executors"):
        Settings()


async def test_ed25519_signs_alike_on_the_loop_in_threads_and_in_pool_processes(
    tmp_path: Path,
) -> None:
    # Handles never cross a process boundary: a pool process loads the keyring and builds its
    # own (libsodium's secret key included) from the seed. Both signing paths, every executor.
    master = os.urandom(32)
    path = tmp_path / "keyring.json"
    create_keyring_file(path, MasterKey(master))
    manager = KeyManager(FileKeyStore(path), MasterKey(master))
    manager.load()
    seed = os.urandom(32)
    manager.create("ed", "ed25519", material=seed)
    reference = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    messages = [os.urandom(size) for size in (0, 32, SODIUM_MAX_MESSAGE, SODIUM_MAX_MESSAGE + 1)]
    expected = [base64.b64encode(reference.sign(m)).decode() for m in messages]
    items = [SignItem(m, False, SignOptions(), None) for m in messages] * 2
    for kind in ("inline", "thread", "process"):
        process = kind == "process"
        pool = make_executor(
            kind,
            workers=1,
            max_pending=8,
            deadline=30.0,
            initializer=init_worker if process else None,
            initargs=(str(path), master) if process else (),
        )
        await pool.start()
        try:
            runner = CryptoRunner(manager, {"ed25519": pool}, chunk_size=3)
            outcomes = await runner.run("sign", "ed", items)
            assert [o["signature"] for o in outcomes if isinstance(o, dict)] == expected * 2, kind
        finally:
            await pool.close()


def _scope(method: str, path: str, root_path: str = "") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": root_path}


def test_dispatch_matches_exactly_the_crypto_routes() -> None:
    async def other(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    async def endpoint(scope: Any, body: bytes, op: Any, key: str) -> bytes:
        return b"{}"

    dispatch = RequestPipeline(other, endpoint=endpoint, routes=crypto.ROUTES)
    for op in ("encrypt", "decrypt", "sign", "verify", "rewrap", "datakey"):
        target = dispatch.match(_scope("POST", f"/v1/{op}/my-key"))
        assert target is not None
        (operation, route), key = target
        assert (operation, key, route.path) == (op, "my-key", f"/v1/{op}/{{key}}")
    # Mounted under a prefix: the app's own path decides, as in FastAPI's router.
    assert dispatch.match(_scope("POST", "/cryptd/v1/sign/k", "/cryptd")) is not None
    for method, path in [
        ("GET", "/v1/encrypt/k"),  # FastAPI answers 405
        ("POST", "/v1/encrypt/"),
        ("POST", "/v1/encrypt/a/b"),
        ("POST", "/v1/keys/k"),
        ("POST", "/v1/encrypt"),
        ("POST", "/v2/encrypt/k"),
        ("POST", "/x/v1/encrypt/k"),
    ]:
        assert dispatch.match(_scope(method, path)) is None, (method, path)
    assert dispatch.match({"type": "websocket", "path": "/v1/encrypt/k"}) is None
    with pytest.raises(ValueError, match="no crypto routes"):
        RequestPipeline(other, endpoint=endpoint, routes={})


@pytest.mark.slow
def test_routes_beside_the_fast_path_keep_fastapi_answers(server: Server) -> None:
    """Requests near the crypto routes still get FastAPI's (contract-shaped) answers, and the
    fast path's answers carry the same headers as FastAPI's."""
    wrong_method = server.request("GET", "/v1/encrypt/aes256-gcm")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    too_deep = server.request("POST", "/v1/encrypt/aes256-gcm/extra", {"plaintext": ""})
    assert too_deep.status_code == 404
    assert too_deep.json()["error"]["code"] == "not_found"

    plaintext = base64.b64encode(b"fast path").decode()
    response = server.request(
        "POST",
        "/v1/encrypt/aes256-gcm",
        {"plaintext": plaintext},
        headers={"X-Request-ID": "trace-1"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "trace-1"
    assert int(response.headers["content-length"]) == len(response.content)
    refused = server.request("POST", "/v1/encrypt/no-such-key", {"plaintext": plaintext})
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "key_not_found"
    assert len(refused.headers["x-request-id"]) == 32


def overloaded(lag: LoopLag) -> bool:
    """The property read anew: mypy keeps it as an earlier assert left it."""
    return lag.overloaded


async def test_loop_lag_sees_a_busy_loop_and_its_recovery() -> None:
    lag = LoopLag(0.05, interval=0.005)
    assert lag.lag == 0.0  # not started: never overloaded
    lag.start()
    try:
        await asyncio.sleep(0.05)
        assert not lag.overloaded
        # Inside one long stretch of work, before the loop can run its timer again:
        deadline = time.monotonic() + 0.12
        while time.monotonic() < deadline:
            pass
        assert lag.lag > 0.05
        assert overloaded(lag)
        await asyncio.sleep(0.02)  # the timer ran: on time again
        assert not lag.overloaded
    finally:
        await lag.close()
    assert lag.lag == 0.0
    with pytest.raises(ValueError, match="positive"):
        LoopLag(0)


@pytest.mark.slow
async def test_a_flooded_event_loop_sheds_crypto_requests_at_once(tmp_path: Path) -> None:
    """Inline work has no executor queue to bound: when requests arrive faster than the loop
    can do them, the loop's lag decides. RSA-4096 signatures (~3 ms) run inline here, and a
    burst of them pushes the lag past 50 ms: the surplus gets 503 overloaded with Retry-After
    before any signing, the rest is served, and the service recovers by itself."""
    server = start_server(
        tmp_path / "flood",
        {"CRYPTD_MAX_LOOP_LAG": "0.05", "CRYPTD_EXECUTORS": '{"rsa-4096": "mixed"}'},
    )
    try:
        body = orjson.dumps({"message": base64.b64encode(b"flood").decode()})
        path = "/v1/sign/rsa-4096"

        async def one(client: httpx.AsyncClient) -> httpx.Response:
            headers = sign_request("POST", path, "", body, server.client_id, server.secret)
            return await client.post(path, content=body, headers=headers)

        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            responses = await asyncio.gather(*(one(client) for _ in range(200)))
            statuses = [r.status_code for r in responses]
            refused = [r for r in responses if r.status_code == 503]
            assert set(statuses) <= {200, 503}
            assert refused, "no request was shed"
            assert statuses.count(200) > 0
            for response in refused:
                assert response.json()["error"]["code"] == "overloaded"
                assert response.headers["retry-after"] == "1"
            await asyncio.sleep(0.5)
            assert (await one(client)).status_code == 200  # recovered
            metrics = (await client.get("/metrics")).text
            assert 'cryptd_rejections_total{cause="overload"}' in metrics
    finally:
        stop_server(server)


async def test_sliced_runs_every_item_on_the_loop_one_call_each(tmp_path: Path) -> None:
    threads: list[int] = []

    def observe(op: str, key_type: str, seconds: float, outcome: str, items: int) -> None:
        threads.append(threading.get_ident())

    manager = _manager(tmp_path)
    sliced = make_executor("sliced", workers=1, max_pending=8, deadline=10.0, slice_budget=0.001)
    await sliced.start()
    try:
        runner = CryptoRunner(manager, {"rsa-2048": sliced}, chunk_size=64, observer=observe)
        item = SignItem(b"message", False, SignOptions(algorithm="pss"), None)
        outcomes = await runner.run("sign", "signing", [item] * 5)
        signatures = [o["signature"] for o in outcomes if isinstance(o, dict)]
        assert len(signatures) == 5
        assert len(set(signatures)) == 5  # PSS is randomised: five real signatures
        assert set(threads) == {threading.get_ident()}  # all on the event loop
        assert sliced.stats().completed_total == 5  # a batch runs one item per call
        message = base64.b64encode(b"message").decode()
        parse = PARSERS["verify"]
        verify = [
            parse({"message": message, "signature": s, "algorithm": "pss"}) for s in signatures
        ]
        checked = await runner.run("verify", "signing", verify)
        assert [o["valid"] for o in checked if isinstance(o, dict)] == [True] * 5
    finally:
        await sliced.close()


async def test_the_runner_tells_which_keys_run_sliced_in_the_current_keyring(
    tmp_path: Path,
) -> None:
    manager = _manager(tmp_path)
    sliced = make_executor("sliced", workers=1, max_pending=8, deadline=10.0)
    inline = make_executor("inline", workers=1, max_pending=8, deadline=10.0)
    runner = CryptoRunner(
        manager, {"rsa-2048": sliced, "aes256-gcm": inline, "sm2": inline}, chunk_size=64
    )
    assert runner.sliced("signing")
    assert not runner.sliced("data")
    assert not runner.sliced("no-such-key")
    manager.create("later", "rsa-2048")  # a new snapshot: looked at again
    manager.create("other", "sm2")
    assert runner.sliced("later")
    assert not runner.sliced("other")
    assert runner.sliced("signing")


def test_sliced_placement_its_budget_and_share_are_configurable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CRYPTD_ENV", "development")
    monkeypatch.setenv("CRYPTD_EXECUTORS", '{"rsa-2048": "sliced"}')
    monkeypatch.setenv("CRYPTD_SLICE_BUDGET", "0.003")
    monkeypatch.setenv("CRYPTD_SLICE_SHARE", "0.5")
    settings = Settings()
    assert settings.executor_kind("rsa-2048") == "sliced"
    assert settings.slice_budget == 0.003
    assert settings.slice_share == 0.5
    assert "rsa-2048" not in settings.single_items_inline()
    monkeypatch.setenv("CRYPTD_SLICE_BUDGET", "0")
    with pytest.raises(ValueError, match="slice_budget"):
        Settings()
    monkeypatch.setenv("CRYPTD_SLICE_BUDGET", "0.003")
    for share in ("0", "1", "1.2"):
        monkeypatch.setenv("CRYPTD_SLICE_SHARE", share)
        with pytest.raises(ValueError, match="slice_share"):
            Settings()
