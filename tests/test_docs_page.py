"""/docs works offline: headless Chromium (Debian's, driven by Playwright) renders
every operation from the served document, no request leaves the host, and in development "Try
it out" signs its requests in the browser, so an encrypt and a sign made from the page succeed
and their answers decrypt and verify with the Python client. (Production keeps the pages off
unless CRYPTD_DOCS=true, and never signs: tests/test_docs_config.py.)"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from cryptd_client import CryptdClient, sign_request
from service.api import spec
from tests.conftest import Server

pytestmark = pytest.mark.slow  # Chromium and a live server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI") == "true":
            pytest.fail("Chromium is required under CI (apt-get install chromium)")
        pytest.skip("Chromium is not installed")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            # No sandbox: CI runs as root. Quiet the browser's own background traffic; every
            # request the page makes is still observed below.
            args=["--no-sandbox", "--disable-background-networking", "--no-first-run"],
        )
        yield launched
        launched.close()


def _visit(browser: object, url: str, ready: str) -> tuple[object, list[str], list[str]]:
    """Open ``url``; every request the page makes is recorded, and any that is not for the
    server's own origin is aborted, so a CDN reference fails the render as well as the
    assertion. Returns (page, requested URLs, console errors)."""
    origin = urlsplit(url)
    context = browser.new_context()  # type: ignore[attr-defined]
    requested: list[str] = []
    errors: list[str] = []

    def route(route: object) -> None:
        target = urlsplit(route.request.url)  # type: ignore[attr-defined]
        requested.append(route.request.url)  # type: ignore[attr-defined]
        if (target.scheme, target.netloc) == (origin.scheme, origin.netloc) or target.scheme in (
            "data",
            "blob",
        ):
            route.continue_()  # type: ignore[attr-defined]
        else:
            route.abort()  # type: ignore[attr-defined]

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="networkidle")
    page.wait_for_selector(ready, timeout=60_000)
    page.wait_for_load_state("networkidle")
    return page, requested, errors


def _foreign(requested: list[str], url: str) -> list[str]:
    origin = urlsplit(url).netloc
    return [r for r in requested if urlsplit(r).netloc not in (origin, "")]


def test_swagger_ui_renders_every_operation_offline(
    browser: object, server: Server, tmp_path: Path
) -> None:
    page, requested, errors = _visit(browser, server.url + "/docs", ".opblock")
    paths = page.locator(".opblock-summary-path").all_inner_texts()  # type: ignore[attr-defined]
    methods = page.locator(".opblock-summary-method").all_inner_texts()  # type: ignore[attr-defined]
    shown = {
        (m.strip(), p.strip().replace("\u200b", "")) for m, p in zip(methods, paths, strict=True)
    }
    assert shown == {(r.method, r.path) for r in spec.ROUTES}
    assert page.locator(".scheme-container .authorize").count() == 1  # type: ignore[attr-defined]
    assert page.locator("#cryptd-signer-load").is_visible()  # type: ignore[attr-defined]
    assert not _foreign(requested, server.url), requested
    assert server.url + "/openapi.json" in requested
    assert not errors, errors
    page.screenshot(path=str(tmp_path / "docs.png"))  # type: ignore[attr-defined]


def test_pages_carry_a_policy_that_keeps_them_on_this_origin(server: Server) -> None:
    for path in ("/docs",):
        answer = httpx.get(server.url + path)
        assert answer.status_code == 200
        policy = answer.headers["content-security-policy"]
        assert "connect-src 'self'" in policy
        assert "default-src 'none'" in policy
        assert "https://" not in answer.text
        assert "http://" not in answer.text


def _try_it_out(page: Any, operation: str, key: str, body: str) -> tuple[int, dict[str, Any]]:
    """Expand one operation, fill its key and body, press Execute, return the answer shown."""
    from playwright.sync_api import expect

    block = page.locator(f"#operations-{operation}")
    if block.locator(".try-out__btn").count() == 0:
        block.locator(".opblock-summary").first.click()
    if block.locator(".try-out__btn.cancel").count() == 0:  # not in "Try it out" mode yet
        block.locator(".try-out__btn").click()
    block.locator('tr[data-param-name="key"] input').fill(key)
    block.locator("textarea.body-param__text").fill(body)
    with page.expect_response(lambda r: f"/{operation.split('-')[1]}/{key}" in r.url) as answer:
        block.locator("button.execute").click()
    response = answer.value
    shown = block.locator(".live-responses-table tbody .response-col_status").first
    expect(shown).to_have_text(str(response.status))  # the page shows what the server said
    return response.status, response.json()


def _wait_signing(page: Any, client_id: str) -> None:
    page.wait_for_selector('#cryptd-signer-status[data-state="signing"]', timeout=10_000)
    assert f'"{client_id}"' in page.locator("#cryptd-signer-status").inner_text()


def test_try_it_out_signs_in_the_browser(browser: object, server: Server) -> None:
    """Unsigned, "Try it out" is refused (401); with the development client (fetched when the
    page asks) an encrypt is answered 200 with a ciphertext the Python client decrypts; with a
    secret pasted into the page a sign is answered 200 with a signature the Python client
    verifies. Every /v1/ request carries the RFC 9421 headers; nothing leaves the host."""
    page, requested, errors = _visit(browser, server.url + "/docs", ".opblock")
    sent: list[dict[str, str]] = []
    page.on(  # type: ignore[attr-defined]
        "request", lambda r: sent.append(r.headers) if "/v1/" in r.url else None
    )
    plaintext = secrets.token_bytes(24)
    body = json.dumps({"plaintext": base64.b64encode(plaintext).decode()}, indent=2)

    status, answer = _try_it_out(page, "crypto-encrypt", "aes256-gcm", body)
    assert (status, answer["error"]["code"]) == (401, "unauthenticated")

    page.locator("#cryptd-signer-load").click()  # type: ignore[attr-defined]
    _wait_signing(page, "dev")
    status, answer = _try_it_out(page, "crypto-encrypt", "aes256-gcm", body)
    assert status == 200, answer
    secret_b64 = base64.b64encode(server.secret).decode()
    with CryptdClient(server.url, server.client_id, secret_b64) as client:
        assert client.decrypt("aes256-gcm", answer["ciphertext"]).plaintext == plaintext

    page.locator("#cryptd-signer-forget").click()  # type: ignore[attr-defined]
    page.locator("#cryptd-signer-id").fill(server.client_id)  # type: ignore[attr-defined]
    page.locator("#cryptd-signer-secret").fill(secret_b64)  # type: ignore[attr-defined]
    page.locator("#cryptd-signer-form button[type=submit]").click()  # type: ignore[attr-defined]
    _wait_signing(page, server.client_id)
    assert page.locator("#cryptd-signer-secret").input_value() == ""  # type: ignore[attr-defined]
    message = secrets.token_bytes(40)
    body = json.dumps({"message": base64.b64encode(message).decode()})
    status, answer = _try_it_out(page, "crypto-sign", "ed25519", body)
    assert status == 200, answer
    with CryptdClient(server.url, server.client_id, secret_b64) as client:
        signature = base64.b64decode(answer["signature"])
        assert client.verify("ed25519", message, signature=signature) is True
        assert client.verify("ed25519", message + b"!", signature=signature) is False

    assert len(sent) == 3
    assert "signature" not in sent[0]
    for headers in sent[1:]:
        assert headers["signature-input"].startswith(
            'sig1=("@method" "@path" "@query" "content-digest" "content-type");created='
        )
        assert headers["content-type"] == "application/json"
    assert not _foreign(requested, server.url), requested
    assert [e for e in errors if "401" not in e] == [], errors


_SIGN_IN_PAGE = """async ([method, target, body, clientId, secret, created, nonce]) => {
  const raw = Uint8Array.from(atob(secret), (c) => c.charCodeAt(0));
  const key = await crypto.subtle.importKey(
    "raw", raw, { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  return window.cryptdSignatureHeaders(
    method, new URL(target, location.href), body, clientId, key, created, nonce);
}"""


def test_page_signer_matches_the_known_answer_vector(browser: object, server: Server) -> None:
    """The page's WebCrypto signer gives docs/AUTH.md's vector, and the Python signer's
    headers for a percent-encoded path, a query and an empty body."""
    vector = json.loads((Path(__file__).parent / "vectors" / "request_signature.json").read_text())
    page, _, errors = _visit(browser, server.url + "/docs", ".opblock")
    cases = [
        (vector["method"], vector["path"], vector["query"], vector["body"]),
        ("POST", "/v1/encrypt/my%20key", "a=1&b=%2F", '{"plaintext": "eA=="}'),
        ("GET", "/v1/keys", "", ""),
    ]
    for method, path, query, body in cases:
        target = path + (f"?{query}" if query else "")
        args = [method, target, body, vector["client_id"], vector["secret"]]
        headers = page.evaluate(  # type: ignore[attr-defined]
            _SIGN_IN_PAGE, [*args, vector["created"], vector["nonce"]]
        )
        assert headers == sign_request(
            method,
            path,
            query,
            body.encode(),
            vector["client_id"],
            base64.b64decode(vector["secret"]),
            created=vector["created"],
            nonce=vector["nonce"],
        )
        if path == vector["path"]:
            assert headers == vector["headers"]
    assert not errors, errors
