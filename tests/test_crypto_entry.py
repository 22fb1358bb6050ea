"""The crypto operations' single entry (service/api/pipeline.py) against the layered path.

Every crypto request used to pass the edge as five ASGI layers and FastAPI's routing; now one
coroutine does the same work. The layered path is still there (every other route uses it, and
the crypto routes stay declared in FastAPI), so the two are compared request by request: the
same status, error body, headers, audit and metrics for valid requests and for every way a
request can be refused (signature, replay, body size, policy, key name, schema, overload)."""

from __future__ import annotations

import base64
import copy
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest.hotpath import application, scope_for
from service.auth.signature import sign_request

pytestmark = pytest.mark.slow  # both request paths of the whole application, side by side

Request = tuple[str, bytes, list[tuple[bytes, bytes]]]


_ROOT: list[Any] = []  # the FastAPI app, as Starlette puts it in every scope


@pytest.fixture
async def entry() -> AsyncIterator[tuple[Any, Any, dict[str, Any]]]:
    with application() as (app, credential):
        async with app.router.lifespan_context(app):
            dispatch = app.build_middleware_stack()
            _ROOT[:] = [app]
            layered = copy.copy(dispatch)
            layered.routes = {}  # the same checks, then FastAPI's crypto routes
            yield dispatch, layered, credential


def _signed(
    credential: dict[str, Any], path: str, body: bytes, **extra: str
) -> list[tuple[bytes, bytes]]:
    secret = base64.b64decode(credential["secret"])
    headers = sign_request("POST", path, "", body, credential["client_id"], secret)
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw += [(k.encode(), v.encode()) for k, v in extra.items()]
    raw.append((b"content-length", str(len(body)).encode()))
    return raw


async def _call(
    app: Any, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[int, dict[str, bytes], bytes]:
    pending = list(chunks)
    status = 0
    response_headers: dict[str, bytes] = {}
    body = b""

    async def receive() -> dict[str, Any]:
        if not pending:
            return {"type": "http.disconnect"}
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: Any) -> None:
        nonlocal status, body
        if message["type"] == "http.response.start":
            status = message["status"]
            response_headers.update({k.decode(): v for k, v in message["headers"]})
        else:
            body += message.get("body", b"")

    scope = scope_for(path, headers)
    scope["app"] = _ROOT[0]
    await app(scope, receive, send)
    return status, response_headers, body


def _same_answer(fast: tuple[int, dict[str, bytes], bytes], layered: Any) -> None:
    assert fast[0] == layered[0]
    for name in ("content-type", "retry-after", "connection"):
        assert fast[1].get(name) == layered[1].get(name), name
    assert "x-request-id" in fast[1]
    assert "x-request-id" in layered[1]
    assert int(fast[1]["content-length"]) == len(fast[2])
    if fast[0] == 200:
        assert orjson.loads(fast[2]).keys() == orjson.loads(layered[2]).keys()
    else:
        assert orjson.loads(fast[2]) == orjson.loads(layered[2])


PLAINTEXT = base64.b64encode(b"the fast path and the layered one").decode()


async def test_valid_and_refused_requests_get_the_same_answers(
    entry: tuple[Any, Any, dict[str, Any]],
) -> None:
    fast, layered, credential = entry
    encrypt = "/v1/encrypt/aes256-gcm"
    good = orjson.dumps({"plaintext": PLAINTEXT})
    cases: list[tuple[str, bytes, dict[str, str], list[bytes] | None]] = [
        (encrypt, good, {}, None),
        (encrypt, good, {"x-request-id": "trace-42"}, None),
        (encrypt, good, {"x-request-id": "x" * 500}, None),  # not echoed: a fresh id
        (encrypt, good, {}, [good[:5], good[5:]]),  # a body in two chunks
        ("/v1/sign/ed25519", orjson.dumps({"message": PLAINTEXT}), {}, None),
        ("/v1/encrypt/no-such-key", good, {}, None),  # 404
        ("/v1/encrypt/bad%20name", good, {}, None),  # 400 key name
        (encrypt, b"not json", {}, None),  # 400
        (encrypt, orjson.dumps({"plaintext": PLAINTEXT, "extra": 1}), {}, None),  # 422
        (encrypt, orjson.dumps({"plaintext": 7}), {}, None),  # 400 wrong type
        ("/v1/sign/aes256-gcm", orjson.dumps({"message": PLAINTEXT}), {}, None),  # 400 op
        (encrypt, orjson.dumps({"batch": [{"plaintext": PLAINTEXT}, {"plaintext": 1}]}), {}, None),
        (encrypt, orjson.dumps({"batch": []}), {}, None),
    ]
    for path, body, extra, chunks in cases:
        answers = []
        for app in (fast, layered):
            headers = _signed(credential, path.replace("%20", " "), body, **extra)
            scope_path = path.replace("%20", " ")
            answers.append(await _call(app, scope_path, headers, chunks or [body]))
        _same_answer(*answers)
        if extra.get("x-request-id") == "trace-42":
            assert answers[0][1]["x-request-id"] == b"trace-42"
        if "x-request-id" in extra and len(extra["x-request-id"]) > 128:
            assert answers[0][1]["x-request-id"] != extra["x-request-id"].encode()


async def test_authentication_refusals_are_the_same(
    entry: tuple[Any, Any, dict[str, Any]],
) -> None:
    fast, layered, credential = entry
    path = "/v1/encrypt/aes256-gcm"
    body = orjson.dumps({"plaintext": PLAINTEXT})
    for app in (fast, layered):
        unsigned = await _call(app, path, [(b"content-length", b"3")], [b"{}x"])
        assert unsigned[0] == 401
        headers = _signed(credential, path, body)
        first = await _call(app, path, headers, [body])
        replayed = await _call(app, path, headers, [body])
        assert (first[0], replayed[0]) == (200, 401)
        tampered = await _call(app, path, _signed(credential, path, body), [body[:-2] + b"!}"])
        assert tampered[0] == 401
        # Upper-case and repeated field names are read as the layered path reads them.
        upper = [(k.upper(), v) for k, v in _signed(credential, path, body)]
        assert (await _call(app, path, upper, [body]))[0] == 200
    answers = [await _call(app, path, [(b"content-length", b"3")], [b"{}x"]) for app in entry[:2]]
    _same_answer(*answers)


async def test_body_limit_is_the_same(entry: tuple[Any, Any, dict[str, Any]]) -> None:
    fast, layered, credential = entry
    path = "/v1/encrypt/aes256-gcm"
    big = orjson.dumps({"plaintext": base64.b64encode(os.urandom(800_000)).decode()})
    answers = []
    for app in (fast, layered):
        declared = await _call(app, path, _signed(credential, path, big), [big])
        headers = [h for h in _signed(credential, path, big) if h[0] != b"content-length"]
        streamed = await _call(app, path, headers, [big[:600_000], big[600_000:]])
        assert declared[0] == streamed[0] == 413
        answers.append(declared)
    _same_answer(*answers)


async def test_an_overloaded_loop_refuses_the_same_way(
    entry: tuple[Any, Any, dict[str, Any]],
) -> None:
    fast, _, credential = entry
    path = "/v1/encrypt/aes256-gcm"
    body = orjson.dumps({"plaintext": PLAINTEXT})
    fast.overloaded = lambda: True
    status, headers, answer = await _call(fast, path, _signed(credential, path, body), [body])
    assert status == 503
    assert orjson.loads(answer)["error"]["code"] == "overloaded"
    assert headers["retry-after"] == b"1"
    assert "x-request-id" in headers


async def test_an_unexpected_error_is_a_bare_500(
    entry: tuple[Any, Any, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    fast, _, credential = entry
    path = "/v1/encrypt/aes256-gcm"
    body = orjson.dumps({"plaintext": PLAINTEXT})

    async def broken(*_args: Any) -> bytes:
        raise RuntimeError("secret detail")

    fast.endpoint = broken
    status, headers, answer = await _call(fast, path, _signed(credential, path, body), [body])
    assert status == 500
    assert orjson.loads(answer) == {"error": {"code": "internal", "message": "internal error"}}
    assert "x-request-id" in headers
    assert "secret detail" not in caplog.text


async def test_requests_that_sliced_work_yields_to_are_counted_while_in_progress(
    entry: tuple[Any, Any, dict[str, Any]],
) -> None:
    """The sliced executor (RSA-2048 and SM2 by default) takes only its share of the loop
    while cheap requests are in progress: the entry counts every crypto request whose key
    does not run sliced, from its first byte read to its answer, whatever the outcome."""
    fast, _, credential = entry
    seen: list[int] = []
    original = fast.endpoint

    async def observed(*args: Any) -> bytes:
        seen.append(fast.cheap.count)
        answer: bytes = await original(*args)
        return answer

    fast.endpoint = observed
    message = orjson.dumps({"message": PLAINTEXT})
    cases = [
        ("/v1/encrypt/aes256-gcm", orjson.dumps({"plaintext": PLAINTEXT}), 200, 1),
        ("/v1/sign/ed25519", message, 200, 1),
        ("/v1/sign/ecdsa-p256", orjson.dumps({"batch": [{"message": PLAINTEXT}] * 3}), 200, 1),
        ("/v1/sign/rsa-2048", message, 200, 0),  # sliced: does not count itself
        ("/v1/sign/sm2", message, 200, 0),
        ("/v1/encrypt/no-such-key", orjson.dumps({"plaintext": PLAINTEXT}), 404, 1),
    ]
    for path, body, status, inside in cases:
        seen.clear()
        answer = await _call(fast, path, _signed(credential, path, body), [body])
        assert answer[0] == status, (path, answer)
        assert seen == [inside], path
        assert fast.cheap.count == 0, path  # every request ended, every count taken back
    # Refused before the endpoint (unsigned): counted while in progress, taken back.
    assert (await _call(fast, "/v1/encrypt/aes256-gcm", [], [b"{}"]))[0] == 401
    assert fast.cheap.count == 0


async def test_other_routes_take_the_layered_path(
    entry: tuple[Any, Any, dict[str, Any]],
) -> None:
    fast, _, credential = entry
    called = []
    original = fast.app

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope["path"])
        await original(scope, receive, send)

    fast.app = spy
    body = b"{}"
    status, _, _ = await _call(fast, "/v1/keys", _signed(credential, "/v1/keys", body), [body])
    assert called == ["/v1/keys"]
    assert status in (200, 405)


def test_fresh_request_ids_are_unique_in_a_process_and_across_forks() -> None:
    import re

    from service.asgi import request_id_of

    ids = {request_id_of(b"") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(rb"[0-9a-f]{32}", i) for i in ids)
    assert request_id_of(b"client-id.1") == b"client-id.1"
    assert request_id_of(b"bad id") != b"bad id"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a prefix of its own
        os.write(write, request_id_of(b""))
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64)
    os.close(read)
    os.close(write)
    assert child[:16] != request_id_of(b"")[:16]


async def test_the_app_shortens_the_gil_switch_interval(
    entry: tuple[Any, Any, dict[str, Any]],
) -> None:
    import sys

    from service.config import Settings

    # A crypto thread's result waits at most this long for the busy event loop.
    assert sys.getswitchinterval() == pytest.approx(Settings().gil_switch_interval)
    assert Settings().gil_switch_interval == pytest.approx(0.0005)


def test_pool_threads_follow_the_cpus_the_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from service import config, cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3})
    assert cpus.available_cpus() == 1
    monkeypatch.setenv("CRYPTD_ENV", "development")
    assert config.Settings(workers=1).pool_workers == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    # (Two workers need a replay store they share: the directory stands for one.)
    assert config.Settings(workers=2, replay_dir=Path("/nonexistent")).pool_workers == 2
