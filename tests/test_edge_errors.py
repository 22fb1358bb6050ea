"""Edge errors of the API on a real server: 415 for bodies that are not JSON, encoded key
names, the Allow header of 405, the upper bound of key_version."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

import orjson
import pytest

from service.auth.signature import (
    COVERED_COMPONENTS,
    content_digest,
    serialize_signature_params,
    sign_request,
    signature_base,
)
from service.keys.keyring import MAX_KEY_VERSION
from tests.conftest import Server
from tests.test_api import assert_error

pytestmark = pytest.mark.slow  # a live server

BODY = orjson.dumps({"plaintext": base64.b64encode(b"x").decode()})


def sign_over(
    path: str, body: bytes, client_id: str, secret: bytes, content_type: str
) -> dict[str, str]:
    """Signature headers of a POST whose covered Content-Type is ``content_type`` (the signing
    recipe of docs/AUTH.md, any media type)."""
    params = serialize_signature_params(
        COVERED_COMPONENTS,
        (
            ("created", int(time.time())),
            ("nonce", secrets.token_hex(16)),
            ("keyid", client_id),
            ("alg", "hmac-sha256"),
        ),
    )
    digest = content_digest(body)
    components = (
        ("@method", "POST"),
        ("@path", path),
        ("@query", "?"),
        ("content-digest", digest),
        ("content-type", content_type),
    )
    mac = hmac.new(secret, signature_base(components, params), hashlib.sha256).digest()
    return {
        "Content-Type": content_type,
        "Content-Digest": digest,
        "Signature-Input": f"sig1={params}",
        "Signature": f"sig1=:{base64.b64encode(mac).decode()}:",
    }


def signed_with_type(server: Server, content_type: str) -> tuple[int, str]:
    """A request signed over ``content_type`` (the signature covers it): authentic, so what
    answers is the media type check."""
    path = "/v1/encrypt/aes256-gcm"
    headers = sign_over(path, BODY, server.client_id, server.secret, content_type)
    response = server.request(
        "POST", "/v1/encrypt/aes256-gcm", raw=BODY, headers=headers, sign=False
    )
    code = response.json()["error"]["code"] if response.status_code != 200 else ""
    return response.status_code, code


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/xml",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "application/json; charset=latin-1",
        "",
    ],
)
def test_body_that_is_not_json_is_415(server: Server, content_type: str) -> None:
    assert signed_with_type(server, content_type) == (415, "unsupported_media_type")


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", "Application/JSON", 'application/json;charset="UTF-8"'],
)
def test_json_with_parameters_is_accepted(server: Server, content_type: str) -> None:
    assert signed_with_type(server, content_type) == (200, "")


def test_415_comes_after_authentication(server: Server) -> None:
    unsigned = server.request(
        "POST",
        "/v1/encrypt/aes256-gcm",
        raw=BODY,
        headers={"Content-Type": "text/plain"},
        sign=False,
    )
    assert_error(unsigned, 401, "unauthenticated")
    signed = server.request(
        "POST",
        "/v1/encrypt/aes256-gcm",
        raw=BODY,
        sign=False,
        headers=sign_over(
            "/v1/encrypt/aes256-gcm", BODY, server.client_id, server.secret, "application/xml"
        ),
    )
    assert_error(signed, 415, "unsupported_media_type")
    assert signed.headers["x-request-id"]


def test_empty_body_needs_no_content_type(server: Server) -> None:
    headers = sign_request("GET", "/v1/keys", "", b"", server.client_id, server.secret)
    response = server.request("GET", "/v1/keys", headers=headers, sign=False)
    assert response.status_code == 200


KEYED_ROUTES = [
    ("POST", "/v1/encrypt/{}"),
    ("POST", "/v1/decrypt/{}"),
    ("POST", "/v1/sign/{}"),
    ("POST", "/v1/verify/{}"),
    ("POST", "/v1/rewrap/{}"),
    ("POST", "/v1/datakey/{}"),
    ("GET", "/v1/keys/{}"),
    ("POST", "/v1/keys/{}"),
    ("PATCH", "/v1/keys/{}"),
    ("DELETE", "/v1/keys/{}"),
    ("POST", "/v1/keys/{}/rotate"),
]


@pytest.mark.parametrize(("method", "template"), KEYED_ROUTES)
@pytest.mark.parametrize("name", ["a%2Fb", "%2F", "aes256-gcm%2F..", "x%00y", "%C3%A9", "a%20b"])
def test_bad_encoded_key_name_is_400_on_every_route(
    server: Server, method: str, template: str, name: str
) -> None:
    response = server.request(method, template.format(name), {"type": "aes256-gcm"})
    assert_error(response, 400, "invalid_request")


def test_encoded_valid_key_name_is_the_key(server: Server) -> None:
    response = server.request("POST", "/v1/encrypt/aes256%2Dgcm", {"plaintext": ""})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "methods"),
    [
        ("/v1/keys/aes256-gcm", "DELETE, GET, PATCH, POST"),
        ("/v1/keys/aes256-gcm/rotate", "POST"),
        ("/v1/keys", "GET"),
        ("/v1/encrypt/aes256-gcm", "POST"),
    ],
)
def test_allow_lists_every_method_of_the_path(server: Server, path: str, methods: str) -> None:
    response = server.request("PUT", path, {})
    assert_error(response, 405, "method_not_allowed")
    listed = set(response.headers["allow"].split(", "))
    assert listed - {"HEAD"} == set(methods.split(", "))
    # HEAD is listed exactly where GET is, and answered there (below).
    assert ("HEAD" in listed) == ("GET" in listed)


@pytest.mark.parametrize(
    ("path", "signed"),
    [
        ("/healthz", False),
        ("/readyz", False),
        ("/metrics", False),
        ("/v1/keys", True),
        ("/v1/keys/aes256-gcm", True),
        ("/v1/keys/wrapping-key", True),
        ("/v1/keys/aes256-gcm/backup", True),
    ],
)
def test_head_is_the_get_without_its_body(server: Server, path: str, signed: bool) -> None:
    get = server.request("GET", path, sign=signed)
    head = server.request("HEAD", path, sign=signed)  # signed as HEAD
    assert get.status_code == 200, get.text
    assert head.status_code == 200
    assert head.content == b""
    # RFC 9110 9.3.2: the header fields the GET would send, its Content-Length included.
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/metrics":  # the exposition changes between two scrapes
        assert int(head.headers["content-length"]) == len(get.content)
    assert head.headers["x-request-id"]


def test_every_path_that_lists_head_answers_it(server: Server) -> None:
    from service.api.spec import ROUTES, allowed_methods

    for route in ROUTES:
        # An approval that does not exist: HEAD answers as GET does (404), never 405.
        path = route.path.replace("{key}", "aes256-gcm").replace("{approval_id}", "0" * 32)
        head = server.request("HEAD", path, sign=route.signed)
        if "HEAD" in allowed_methods(path):
            expected = 404 if "{approval_id}" in route.path else 200
            assert head.status_code == expected, path
        else:
            assert head.status_code == 405, path
            assert "HEAD" not in head.headers["allow"]
            assert "GET" not in head.headers["allow"]


def test_head_is_verified_as_sent_and_authorised_as_get(server: Server) -> None:
    path = "/v1/keys/aes256-gcm"
    # A GET's signature does not authenticate a HEAD (the method is covered)...
    as_get = sign_request("GET", path, "", b"", server.client_id, server.secret)
    refused = server.request("HEAD", path, headers=as_get, sign=False)
    assert refused.status_code == 401
    assert refused.content == b""
    # ... nor does no signature at all.
    assert server.request("HEAD", path, sign=False).status_code == 401
    # Unknown key: the GET's 404, without its body.
    missing = server.request("HEAD", "/v1/keys/no-such-key")
    assert missing.status_code == 404
    assert missing.content == b""
    # A bad key name: the GET's 400.
    assert server.request("HEAD", "/v1/keys/a%2Fb").status_code == 400


@pytest.mark.parametrize(
    ("version", "status", "code"),
    [
        (MAX_KEY_VERSION, 404, "key_not_found"),
        (MAX_KEY_VERSION + 1, 400, "invalid_request"),
        (2**63, 400, "invalid_request"),
        (2**64 + 1, 400, "invalid_request"),
        (0, 400, "invalid_request"),
    ],
)
def test_key_version_upper_bound(server: Server, version: int, status: int, code: str) -> None:
    raw = b'{"plaintext":"","key_version":%d}' % version  # beyond what orjson writes, too
    for path in ("/v1/encrypt/aes256-gcm", "/v1/sign/ed25519"):
        body = raw if "encrypt" in path else raw.replace(b'"plaintext"', b'"message"')
        assert_error(server.request("POST", path, raw=body), status, code)


def test_token_naming_a_version_above_the_bound_is_400(server: Server) -> None:
    token = server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}).json()["ciphertext"]
    forged = token.replace("cryptd:v1:", f"cryptd:v{MAX_KEY_VERSION + 1}:")
    response = server.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": forged})
    assert_error(response, 400, "invalid_request")


def test_415_on_the_layered_path_too(server: Server) -> None:
    """Key management goes through the ASGI layers, not the crypto entry: same answer."""
    path = "/v1/keys/media-type-test"
    body = orjson.dumps({"type": "aes256-gcm"})
    headers = sign_over(path, body, server.client_id, server.secret, "text/plain")
    response = server.request("POST", path, raw=body, headers=headers, sign=False)
    assert_error(response, 415, "unsupported_media_type")
    assert response.headers["x-request-id"]
    assert_error(server.request("GET", "/v1/keys/media-type-test"), 404, "key_not_found")
