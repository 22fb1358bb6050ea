"""What request authentication costs the server, measured in-process (``python -m
loadtest.overhead``).

Auth cannot be switched off in cryptd, so its share of a request is measured directly:

- ``verify_request`` plus the replay-store check, per call, on a real signed request;
- the whole :class:`~service.auth.middleware.SignatureAuthMiddleware` (header extraction, body
  buffering, verify, replay) as an ASGI call, minus the same call without the middleware.

The runner divides these by the server CPU time one request costs at saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from loadtest.scenarios import BY_NAME
from service.asgi import Message, Scope
from service.auth.clients import parse_clients
from service.auth.middleware import SignatureAuthMiddleware
from service.auth.replay import MemoryReplayStore
from service.auth.signature import sign_request, verify_request

CLIENT_ID = "bench"


@dataclass(frozen=True)
class AuthCost:
    scenario: str
    body_bytes: int
    sign_us: float  # client side: sign_request (Python)
    verify_us: float  # verify_request alone
    verify_replay_us: float  # verify_request + MemoryReplayStore check
    middleware_us: float  # SignatureAuthMiddleware minus a bare ASGI call


def _signed(
    path: str, body: bytes, secret: bytes, count: int
) -> list[tuple[dict[str, str], float]]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        headers = sign_request("POST", path, "", body, CLIENT_ID, secret)
        out.append(({k.lower(): v for k, v in headers.items()}, time.perf_counter() - started))
    return out


def _best(samples: Sequence[float]) -> float:
    # Median of repeats: robust against the other users of the shared cores.
    return statistics.median(samples)


def measure(scenario: str = "aes-encrypt", count: int = 5000, repeats: int = 5) -> AuthCost:
    endpoint = BY_NAME[scenario].cryptd
    if endpoint.encrypt_path is not None:
        raise ValueError("pick a scenario whose body needs no ciphertext")
    path = endpoint.path
    body = orjson.dumps(endpoint.body(None))
    secret = os.urandom(32)
    registry = parse_clients(
        {
            "clients": {
                CLIENT_ID: {
                    "secret": base64.b64encode(secret).decode(),
                    "allow": [{"keys": "*", "operations": ["*"]}],
                }
            }
        }
    )

    sign_runs, verify_runs, replay_runs, middleware_runs = [], [], [], []
    for _ in range(repeats):
        requests = _signed(path, body, secret, count)
        sign_runs.append(sum(t for _, t in requests) / count)

        now = time.time()
        started = time.perf_counter()
        for headers, _ in requests:
            verify_request(
                method="POST",
                path=path,
                query="",
                headers=headers,
                body=body,
                secret_for=registry.secret_for,
                now=now,
            )
        verify_runs.append((time.perf_counter() - started) / count)

        store = MemoryReplayStore()
        started = time.perf_counter()
        for headers, _ in requests:
            signed = verify_request(
                method="POST",
                path=path,
                query="",
                headers=headers,
                body=body,
                secret_for=registry.secret_for,
                now=now,
            )
            if not store.remember_now(signed.keyid, signed.nonce, 301, time.monotonic()):
                raise RuntimeError("replay store refused a fresh nonce")
        replay_runs.append((time.perf_counter() - started) / count)

        middleware_runs.append(asyncio.run(_middleware_cost(path, body, registry, requests)))

    return AuthCost(
        scenario=scenario,
        body_bytes=len(body),
        sign_us=_best(sign_runs) * 1e6,
        verify_us=_best(verify_runs) * 1e6,
        verify_replay_us=_best(replay_runs) * 1e6,
        middleware_us=_best(middleware_runs) * 1e6,
    )


async def _middleware_cost(
    path: str,
    body: bytes,
    registry: Any,
    requests: list[tuple[dict[str, str], float]],
) -> float:
    """Seconds per request the middleware adds to a bare ASGI call."""
    answered = 0

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        nonlocal answered
        await receive()
        answered += 1

    async def send(_message: Message) -> None:
        raise RuntimeError("the middleware refused a valid request")

    middleware = SignatureAuthMiddleware(
        app,
        registry_provider=lambda: registry,
        replay=MemoryReplayStore(),
        rate_limiter=None,
        max_age=300,
        fail_open=False,
    )
    scopes = [
        {
            "type": "http",
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"host", b"127.0.0.1")]
            + [(k.encode(), v.encode()) for k, v in headers.items()],
        }
        for headers, _ in requests
    ]

    def receiver() -> Any:
        async def receive() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        return receive

    timings = []
    for target in (app, middleware):
        started = time.perf_counter()
        for scope in scopes:
            await target(scope, receiver(), send)
        timings.append(time.perf_counter() - started)
    if answered != 2 * len(scopes):
        raise RuntimeError("not every request reached the app")
    return (timings[1] - timings[0]) / len(scopes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    results = [
        measure(name, args.count, args.repeats) for name in ("aes-encrypt", "rsa-sign", "aes-batch")
    ]
    if args.json:
        sys.stdout.write(orjson.dumps([asdict(r) for r in results]).decode() + "\n")
        return 0
    print("| scenario | body B | sign (client) us | verify us | verify+replay us | middleware us |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.scenario} | {r.body_bytes:,} | {r.sign_us:.1f} | {r.verify_us:.1f} | "
            f"{r.verify_replay_us:.1f} | {r.middleware_us:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
