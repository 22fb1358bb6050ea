"""SignatureAuthMiddleware against a real uvicorn server: every refusal, policy, rate limit,
logs without secrets, and a signer that is not ours."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_message_signatures import HTTPMessageSigner, MappingKeyResolver
from http_message_signatures.algorithms import HMAC_SHA256

from cryptd_client import signing
from service.asgi import Message
from service.auth.middleware import SignatureAuthMiddleware
from service.auth.policy import STATE_KEY
from service.auth.ratelimit import MemoryRateLimiter
from service.auth.replay import MemoryReplayStore
from service.auth.signature import (
    COVERED_COMPONENTS,
    content_digest,
    hmac_sha256,
    serialize_signature_params,
    sign_request,
    signature_base,
)
from service.errors import RateLimited, Unauthenticated, UnsupportedMediaType
from tests.test_auth_support import Server, make_app, standard_clients

UNAUTHENTICATED = {"error": {"code": "unauthenticated", "message": Unauthenticated.default_message}}


class Harness:
    def __init__(self, tmp_path: Path, **app_options: Any) -> None:
        self.clients_file = tmp_path / "clients.json"
        self.secrets = standard_clients(self.clients_file)
        self.failures: list[str] = []
        self.rejections: list[str] = []
        self.replay = MemoryReplayStore()
        self.app = make_app(
            self.clients_file,
            replay=self.replay,
            failures=self.failures,
            rejections=self.rejections,
            **app_options,
        )

    def sign(
        self,
        method: str,
        path: str,
        body: bytes = b"{}",
        *,
        client: str = "app",
        query: str = "",
        **options: Any,
    ) -> dict[str, str]:
        secret = base64.b64decode(self.secrets[client])
        return sign_request(method, path, query, body, client, secret, **options)


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


@pytest.fixture
def server(harness: Harness) -> Iterator[httpx.Client]:
    with Server(harness.app) as srv, httpx.Client(base_url=srv.url) as http:
        yield http


def test_signed_request_reaches_the_app_with_its_body(
    harness: Harness, server: httpx.Client
) -> None:
    body = b'{"plaintext":"aGVsbG8="}'
    response = server.post(
        "/v1/echo/orders-1?mode=x",
        content=body,
        headers=harness.sign("POST", "/v1/echo/orders-1", body, query="mode=x"),
    )
    assert response.status_code == 200
    assert response.json() == {"client": "app", "body": body.decode(), "query": "mode=x"}
    # GET with an empty body carries the digest of the empty body.
    response = server.get("/v1/keys", headers=harness.sign("GET", "/v1/keys", b""))
    assert response.status_code == 200
    assert harness.failures == []


def test_unprotected_paths_need_no_signature(server: httpx.Client) -> None:
    assert server.get("/healthz").json() == {"status": "ok"}
    assert server.get("/metrics").status_code == 404  # the app answers, not the middleware
    assert server.get("/v1/keys").status_code == 401


def _remove(name: str) -> Callable[[dict[str, str]], None]:
    def remove(headers: dict[str, str]) -> None:
        del headers[name]

    return remove


def _set(name: str, value: str) -> Callable[[dict[str, str]], None]:
    return lambda headers: headers.__setitem__(name, value)


def _resign(
    harness: Harness, components: list[str], params: list[tuple[str, int | str]]
) -> dict[str, str]:
    """Headers MAC'd correctly over a Signature-Input the server must refuse anyway."""
    headers = harness.sign("POST", "/v1/echo/orders-1")
    values = {
        "@method": "POST",
        "@path": "/v1/echo/orders-1",
        "@query": "?",
        "@authority": "127.0.0.1",
        "content-digest": headers["Content-Digest"],
        "content-type": "application/json",
    }
    serialized = serialize_signature_params(components, params)
    base = signature_base([(c, values[c]) for c in components], serialized)
    mac = hmac_sha256(base64.b64decode(harness.secrets["app"]), base)
    headers["Signature-Input"] = f"sig1={serialized}"
    headers["Signature"] = f"sig1=:{base64.b64encode(mac).decode()}:"
    return headers


def _params(**changes: int | str | None) -> list[tuple[str, int | str]]:
    params: dict[str, int | str | None] = {
        "created": int(time.time()),
        "nonce": f"n-{time.monotonic_ns()}",
        "keyid": "app",
        "alg": "hmac-sha256",
    }
    params.update(changes)
    return [(k, v) for k, v in params.items() if v is not None]


# name -> (how to build the request's headers, method/path/body actually sent, expected reason)
Case = tuple[Callable[[Harness], dict[str, str]], tuple[str, str, bytes], str]
POST_ECHO = ("POST", "/v1/echo/orders-1", b"{}")


def _mutated(mutate: Callable[[dict[str, str]], None]) -> Callable[[Harness], dict[str, str]]:
    def build(harness: Harness) -> dict[str, str]:
        headers = harness.sign("POST", "/v1/echo/orders-1")
        mutate(headers)
        return headers

    return build


CASES: dict[str, Case] = {
    "no Signature": (_mutated(_remove("Signature")), POST_ECHO, "missing_signature"),
    "no Signature-Input": (_mutated(_remove("Signature-Input")), POST_ECHO, "missing_signature"),
    "no Content-Digest": (_mutated(_remove("Content-Digest")), POST_ECHO, "missing_header"),
    "no Content-Type": (_mutated(_remove("Content-Type")), POST_ECHO, "missing_header"),
    "bad digest": (
        _mutated(lambda h: None),
        ("POST", "/v1/echo/orders-1", b'{"changed":1}'),
        "bad_digest",
    ),
    "wrong secret": (
        lambda h: sign_request("POST", "/v1/echo/orders-1", "", b"{}", "app", bytes(32)),
        POST_ECHO,
        "bad_signature",
    ),
    "unknown client": (
        lambda h: sign_request("POST", "/v1/echo/orders-1", "", b"{}", "ghost", bytes(32)),
        POST_ECHO,
        "unknown_client",
    ),
    "altered method": (
        _mutated(lambda h: None),
        ("PUT", "/v1/echo/orders-1", b"{}"),
        "bad_signature",
    ),
    "altered path": (
        _mutated(lambda h: None),
        ("POST", "/v1/echo/orders-2", b"{}"),
        "bad_signature",
    ),
    "altered query": (
        _mutated(lambda h: None),
        ("POST", "/v1/echo/orders-1?x=1", b"{}"),
        "bad_signature",
    ),
    "altered content-type": (
        _mutated(_set("Content-Type", "text/plain")),
        POST_ECHO,
        "bad_signature",
    ),
    "altered digest header": (
        _mutated(_set("Content-Digest", content_digest(b"[]"))),
        ("POST", "/v1/echo/orders-1", b"[]"),
        "bad_signature",
    ),
    "stale": (
        lambda h: h.sign("POST", "/v1/echo/orders-1", created=int(time.time()) - 301),
        POST_ECHO,
        "stale",
    ),
    "future": (
        lambda h: h.sign("POST", "/v1/echo/orders-1", created=int(time.time()) + 400),
        POST_ECHO,
        "future",
    ),
    "malformed Signature-Input": (
        _mutated(_set("Signature-Input", "sig1=((")),
        POST_ECHO,
        "malformed",
    ),
    "malformed Signature": (_mutated(_set("Signature", "sig1=:%%%:")), POST_ECHO, "malformed"),
    "malformed Content-Digest": (
        _mutated(_set("Content-Digest", "sha-256")),
        POST_ECHO,
        "malformed",
    ),
    "wrong alg": (
        lambda h: _resign(h, list(COVERED_COMPONENTS), _params(alg="hmac-sha512")),
        POST_ECHO,
        "wrong_alg",
    ),
    "no alg": (
        lambda h: _resign(h, list(COVERED_COMPONENTS), _params(alg=None)),
        POST_ECHO,
        "wrong_alg",
    ),
    "no nonce": (
        lambda h: _resign(h, list(COVERED_COMPONENTS), _params(nonce=None)),
        POST_ECHO,
        "bad_params",
    ),
    "nonce too long": (
        lambda h: _resign(h, list(COVERED_COMPONENTS), _params(nonce="n" * 129)),
        POST_ECHO,
        "bad_params",
    ),
    "no created": (
        lambda h: _resign(h, list(COVERED_COMPONENTS), _params(created=None)),
        POST_ECHO,
        "bad_params",
    ),
    "no keyid": (
        lambda h: _resign(h, list(COVERED_COMPONENTS), _params(keyid=None)),
        POST_ECHO,
        "bad_params",
    ),
    "missing component": (
        lambda h: _resign(h, list(COVERED_COMPONENTS[:-1]), _params()),
        POST_ECHO,
        "bad_components",
    ),
    "extra component": (
        lambda h: _resign(h, [*COVERED_COMPONENTS, "@authority"], _params()),
        POST_ECHO,
        "bad_components",
    ),
    "other components": (
        lambda h: _resign(h, ["@method", "@path", "content-digest", "content-type"], _params()),
        POST_ECHO,
        "bad_components",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_refusal_is_the_same_401(harness: Harness, server: httpx.Client, name: str) -> None:
    build, (method, path, body), reason = CASES[name]
    response = server.request(method, path, content=body, headers=build(harness))
    assert response.status_code == 401
    assert response.json() == UNAUTHENTICATED
    assert harness.failures == [reason]
    assert len(harness.replay) == 0  # no nonce of an unauthenticated request is kept


def test_replay_is_refused(harness: Harness, server: httpx.Client) -> None:
    headers = harness.sign("POST", "/v1/echo/orders-1")
    assert server.post("/v1/echo/orders-1", content=b"{}", headers=headers).status_code == 200
    response = server.post("/v1/echo/orders-1", content=b"{}", headers=headers)
    assert response.status_code == 401
    assert response.json() == UNAUTHENTICATED
    assert harness.failures == ["replayed"]
    # The same nonce from another client is that client's nonce: not a replay.
    other = harness.sign("POST", "/v1/echo/orders-1", client="limited", nonce=_nonce(headers))
    assert server.post("/v1/echo/orders-1", content=b"{}", headers=other).status_code == 200


def _nonce(headers: dict[str, str]) -> str:
    return headers["Signature-Input"].split('nonce="')[1].split('"')[0]


def test_policy_refusals_are_403(harness: Harness, server: httpx.Client) -> None:
    def call(method: str, path: str, client: str, body: bytes = b"{}") -> httpx.Response:
        headers = harness.sign(method, path, body, client=client)
        return server.request(method, path, content=body, headers=headers)

    assert call("POST", "/v1/echo/orders-7", "limited").status_code == 200
    refused = call("POST", "/v1/echo/billing-7", "limited")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "forbidden"
    assert call("POST", "/v1/sign/orders-7", "limited", b'{"message":"aGk="}').status_code == 403
    created = b'{"type":"aes256-gcm"}'
    assert call("POST", "/v1/keys/new-key", "app", created).status_code == 403  # not admin
    assert call("POST", "/v1/keys/new-key", "admin", created).status_code == 201
    assert harness.failures == []


def test_rate_limit_answers_429_with_retry_after(tmp_path: Path) -> None:
    harness = Harness(tmp_path, rate_limiter=MemoryRateLimiter(rate=0.5, burst=2))
    with Server(harness.app) as srv, httpx.Client(base_url=srv.url) as http:
        statuses = []
        for _ in range(3):
            response = http.get("/v1/keys", headers=harness.sign("GET", "/v1/keys", b""))
            statuses.append(response.status_code)
        assert statuses == [200, 200, 429]
        assert response.json()["error"]["code"] == "rate_limited"
        assert response.headers["retry-after"] == "2"  # 1 token at 0.5/s, whole seconds
        # Buckets are per client: another client is not affected.
        other = harness.sign("GET", "/v1/keys", b"", client="admin")
        assert http.get("/v1/keys", headers=other).status_code == 200
    assert harness.rejections == ["rate_limited"]


def test_clients_file_changes_apply_without_restart(harness: Harness, server: httpx.Client) -> None:
    headers = harness.sign("GET", "/v1/keys", b"")
    assert server.get("/v1/keys", headers=headers).status_code == 200
    standard_clients(harness.clients_file)  # every secret replaced
    time.sleep(0.1)  # the test app polls every 50 ms
    stale_secret = harness.sign("GET", "/v1/keys", b"")
    harness.secrets = {}  # the old secrets are gone
    assert server.get("/v1/keys", headers=stale_secret).status_code == 401
    assert harness.failures == ["bad_signature"]


def test_no_secret_or_signature_in_any_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    harness = Harness(tmp_path, rate_limiter=MemoryRateLimiter(rate=1, burst=1))
    sent: list[dict[str, str]] = []
    with Server(harness.app, access_log=True) as srv, httpx.Client(base_url=srv.url) as http:
        for name, (build, (method, path, body), _) in CASES.items():
            headers = build(harness)
            sent.append(headers)
            http.request(method, path, content=body, headers=headers)
            del name
        for _ in range(2):  # an accepted request, then a rate-limited one
            headers = harness.sign("GET", "/v1/keys", b"")
            sent.append(headers)
            http.get("/v1/keys", headers=headers)
        http.get("/v1/keys", headers=sent[-2])  # a replay of the accepted one
    assert harness.rejections == ["rate_limited"]
    assert "replayed" in harness.failures

    forbidden = {base64.b64decode(s).hex() for s in harness.secrets.values()}
    forbidden |= set(harness.secrets.values())
    for headers in sent:
        for name in ("Signature", "Signature-Input"):
            if name in headers and len(headers[name]) > 8:
                forbidden.add(headers[name])
                forbidden.add(headers[name].split("=", 1)[1])
    lines = [caplog.text] + [r.getMessage() for r in caplog.records]
    assert any("unauthenticated (reason=" in line for line in lines)  # logging did happen
    for line in lines:
        assert "sig1=" not in line
        for value in forbidden:
            assert value not in line


def test_a_third_party_signer_is_accepted(harness: Harness, server: httpx.Client) -> None:
    """The http-message-signatures library signs an httpx request; our middleware verifies."""
    secret = base64.b64decode(harness.secrets["app"])
    signer = HTTPMessageSigner(
        signature_algorithm=HMAC_SHA256,
        key_resolver=MappingKeyResolver(public_keys={}, private_keys={"app": secret}),
    )
    body = b'{"plaintext":"aW50ZXJvcA=="}'
    request = server.build_request(
        "POST",
        "/v1/echo/orders-9?q=%2F",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    signer.sign(
        request,
        key_id="app",
        nonce="third-party-1",
        label="sig1",
        covered_component_ids=COVERED_COMPONENTS,
        body=body,
    )
    response = server.send(request)
    assert response.status_code == 200, response.text
    assert response.json()["body"] == body.decode()
    assert server.send(request).status_code == 401  # and its nonce is remembered
    assert harness.failures == ["replayed"]


async def test_websockets_and_mounted_paths_are_protected(harness: Harness) -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def ws_receive() -> Message:
        return {"type": "websocket.connect"}

    await harness.app({"type": "websocket", "path": "/v1/keys", "headers": []}, ws_receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]

    async def http_receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    sent.clear()
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/cryptd/v1/keys",
        "root_path": "/cryptd",
        "query_string": b"",
        "headers": [],
    }
    await harness.app(scope, http_receive, send)
    assert sent[0]["status"] == 401
    assert harness.failures == ["missing_signature"]


@pytest.mark.parametrize("refusal", ["rate_limited", "unsupported_media_type"])
async def test_a_429_or_415_names_the_authenticated_client_for_the_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    harness = Harness(tmp_path, rate_limiter=MemoryRateLimiter(rate=0.5, burst=1))
    middleware = harness.app
    assert isinstance(middleware, SignatureAuthMiddleware)
    body = b'{"plaintext":"aGVsbG8="}'
    if refusal == "rate_limited":  # the bucket's one token goes to a first request
        first = {
            name.lower(): value for name, value in harness.sign("POST", "/v1/echo/k", body).items()
        }
        await middleware.authenticate(_scope(), first, body)
        expected: type[Exception] = RateLimited
    else:
        monkeypatch.setattr(signing, "CONTENT_TYPE", "text/plain")
        expected = UnsupportedMediaType
    headers = {
        name.lower(): value for name, value in harness.sign("POST", "/v1/echo/k", body).items()
    }
    scope = _scope()
    with pytest.raises(expected):
        await middleware.authenticate(scope, headers, body)
    # The access log reads the client from here: the refused request is attributed to it.
    assert scope["state"][STATE_KEY].client_id == "app"


def _scope() -> dict[str, Any]:
    path = "/v1/echo/k"
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "headers": []}  # fmt: skip
