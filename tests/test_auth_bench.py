"""Cost of request authentication, printed (run with -s). No timing assertions: the figures
are for the record (docs/AUTH.md); the test only checks both verifiers agree.

    .venv/bin/pytest tests/test_auth_bench.py -q -s
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import os
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from http_message_signatures import HTTPMessageVerifier, MappingKeyResolver
from http_message_signatures.algorithms import HMAC_SHA256

from service.asgi import Message, Receive, Scope, Send
from service.auth.clients import ClientsFile
from service.auth.middleware import SignatureAuthMiddleware
from service.auth.ratelimit import MemoryRateLimiter
from service.auth.redis_client import close, connect
from service.auth.replay import MemoryReplayStore, RedisReplayStore, ReplayStore
from service.auth.replay_host import HostReplayStore
from service.auth.signature import COVERED_COMPONENTS, sign_request, verify_request
from tests.test_auth_support import SHARED_REDIS_URL, redis_reachable, standard_clients

pytestmark = pytest.mark.slow

PATH = "/v1/encrypt/orders"
BODY = orjson.dumps({"plaintext": base64.b64encode(os.urandom(256)).decode()})


def _best_us(func: Callable[[], object], number: int = 2000) -> float:
    return min(timeit.repeat(func, number=number, repeat=5)) / number * 1e6


class _Message:
    def __init__(self, method: str, url: str, headers: dict[str, str]) -> None:
        self.method, self.url, self.headers = method, url, headers


def test_verify_cost_library_vs_direct() -> None:
    secret = os.urandom(32)
    headers = sign_request("POST", PATH, "", BODY, "app", secret)
    lower = {k.lower(): v for k, v in headers.items()}
    resolver = MappingKeyResolver(public_keys={"app": secret}, private_keys={"app": secret})
    verifier = HTTPMessageVerifier(signature_algorithm=HMAC_SHA256, key_resolver=resolver)
    message = _Message("POST", "http://127.0.0.1:8080" + PATH, headers)

    def library() -> object:
        results = verifier.verify(
            message,
            max_age=datetime.timedelta(seconds=300),
            require_components=COVERED_COMPONENTS,
            body=BODY,
        )
        return results[0].parameters["nonce"]

    def direct() -> object:
        return verify_request(
            method="POST",
            path=PATH,
            query="",
            headers=lower,
            body=BODY,
            secret_for={"app": secret}.get,
            now=time.time(),
        ).nonce

    assert library() == direct()
    lib_us, direct_us = _best_us(library), _best_us(direct)
    sign_us = _best_us(lambda: sign_request("POST", PATH, "", BODY, "app", secret))
    print(
        f"\nverify, http-message-signatures: {lib_us:7.1f} us"
        f"\nverify, direct (http-sfv + hmac): {direct_us:7.1f} us  ({lib_us / direct_us:.0f}x)"
        f"\nsign_request (client side):       {sign_us:7.1f} us"
    )


async def _ok_app(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _drive(app: Any, headers: dict[str, str]) -> int:
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


async def _per_request_us(app: Any, secret: bytes, n: int, concurrency: int = 1) -> float:
    """CPU microseconds per request (the loop's share; Redis runs in its own process)."""
    # Signing happens outside the timed part: it is the client's cost, not the server's.
    requests = [sign_request("POST", PATH, "", BODY, "app", secret) for _ in range(n)]
    started = time.process_time()
    if concurrency == 1:  # no gather(): its own cost would swamp the figures
        for headers in requests:
            assert await _drive(app, headers) == 200
    else:
        for i in range(0, n, concurrency):
            chunk = requests[i : i + concurrency]
            statuses = await asyncio.gather(*(_drive(app, h) for h in chunk))
            assert set(statuses) == {200}
    return (time.process_time() - started) / n * 1e6


async def test_middleware_overhead_in_process(tmp_path: Path) -> None:
    clients = tmp_path / "clients.json"
    secret = base64.b64decode(standard_clients(clients)["app"])
    provider = ClientsFile(clients)

    def wrap(replay: ReplayStore, limiter: MemoryRateLimiter | None) -> SignatureAuthMiddleware:
        return SignatureAuthMiddleware(
            _ok_app,
            registry_provider=provider,
            replay=replay,
            rate_limiter=limiter,
            max_age=300,
            fail_open=False,
        )

    n = 3072
    bare = min([await _per_request_us(_ok_app, secret, n) for _ in range(3)])
    memory = min(
        [await _per_request_us(wrap(MemoryReplayStore(), None), secret, n) for _ in range(3)]
    )
    limited = min(
        [
            await _per_request_us(
                wrap(MemoryReplayStore(), MemoryRateLimiter(1e9, 10**9)), secret, n
            )
            for _ in range(3)
        ]
    )
    host_store = HostReplayStore(tmp_path / "replay", epoch=0)
    host = min([await _per_request_us(wrap(host_store, None), secret, n) for _ in range(3)])
    host_store.close()
    lines = [
        f"\nASGI call, no auth:                         {bare:6.1f} us",
        f"auth middleware, memory replay store:       {memory - bare:6.1f} us added",
        f"  + memory rate limiter:                    {limited - bare:6.1f} us added",
        f"auth middleware, host (LMDB) replay store:  {host - bare:6.1f} us added",
    ]
    if redis_reachable():
        client = connect(SHARED_REDIS_URL)
        try:
            for concurrency in (1, 16, 64):
                store = RedisReplayStore(client)
                app = wrap(store, None)
                base_us = await _per_request_us(_ok_app, secret, 2048, concurrency)
                redis_us = await _per_request_us(app, secret, 2048, concurrency)
                await store.aclose()
                lines.append(
                    f"auth middleware, Redis replay store, {concurrency:2d} concurrent: "
                    f"{redis_us - base_us:6.1f} us added"
                )
        finally:
            await close(client)
    print("\n".join(lines))
    await asyncio.sleep(0)
