"""/docs works offline: headless Chromium (Debian's, driven by Playwright) renders
every operation from the served document, and no request leaves the host. (Production keeps
them off unless CRYPTD_DOCS=true: tests/test_docs_config.py.)"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

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
