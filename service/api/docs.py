"""API documentation that works without internet: ``/openapi.json`` and Swagger UI at ``/docs``,
its scripts and styles served from the ``fastapi-offline`` package (the ``docs`` extra), never
from a CDN; the page's Content-Security-Policy lets it load scripts from and connect to this
origin only. (No Redoc: its standalone build always loads a logo from its vendor's CDN.) Off
unless ``CRYPTD_DOCS=true``; development turns them on by default when the extra is installed.
Unsigned, as documentation is.

In development the page's "Try it out" signs its requests to ``/v1/`` in the browser
(``docs_static/cryptd-docs.js``, WebCrypto HMAC over the signature base of docs/AUTH.md) with
a credential the user gives it: the development client's, fetched when the user asks from
``POST /docs/dev-credential``, or one pasted into the page. That route exists in development
only, when the server listens on a loopback address, and answers only a same-origin request
from the page over loopback to a loopback host name (not another site's page, nor a DNS
rebinding one). Its trade-off: any local program that can reach the port can read the
development client's secret, as the user who started the server can from
``.cryptd-dev/client.json``; on a shared host other local users could too, which is why the
development client guards only throwaway development keys. Anywhere else (``CRYPTD_DOCS=true``
in production) the page is reference only: no credential route, no signing, no "Try it out".
"""

from __future__ import annotations

import base64
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from service.api.openapi import build_document
from service.errors import Forbidden

log = logging.getLogger("cryptd.api")

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
ASSETS_PATH = "/docs-assets"
SCRIPT_PATH = f"{ASSETS_PATH}/cryptd-docs.js"
DEV_CREDENTIAL_PATH = "/docs/dev-credential"
# The client `cryptd serve --dev` creates (service/cli/serve.py; a test keeps the two equal).
DEV_CLIENT_ID = "dev"
_SCRIPT = Path(__file__).parent / "docs_static" / "cryptd-docs.js"
# The page may load from and connect to this origin only: nothing leaves the host. No inline
# script: the page's own code is a file from this origin (Swagger UI needs inline styles).
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}
_NO_STORE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


class DocsUnavailable(RuntimeError):
    """CRYPTD_DOCS is on but the assets package is not installed."""


@dataclass(frozen=True)
class DevClient:
    """The development client the page may sign as: its id, a lookup of its current secret
    in the live clients file, and the address the server listens on."""

    client_id: str
    secret_for: Callable[[str], bytes | None]
    listen_host: str


def assets_directory() -> Path:
    try:
        import fastapi_offline
    except ImportError:
        raise DocsUnavailable(
            "the documentation pages need their assets: pip install 'cryptd[docs]'"
        ) from None
    directory = Path(fastapi_offline.__file__).parent / "static"
    if not (directory / "swagger-ui-bundle.js").is_file():
        raise DocsUnavailable(f"no Swagger UI assets in {directory}")
    return directory


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback."""
    if host.strip("[]") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def install(
    app: FastAPI, *, enabled: bool, required: bool, dev_client: DevClient | None = None
) -> bool:
    """Serve the document and the pages if ``enabled``; without the assets package that is an
    error when ``required`` (CRYPTD_DOCS=true), else the pages stay off. ``dev_client``
    (development only) makes "Try it out" sign. Returns whether the pages are served."""
    app.openapi_schema = build_document()  # what FastAPI's app.openapi() answers
    if not enabled:
        return False
    document = app.openapi_schema

    @app.get(OPENAPI_PATH, include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(document)

    try:
        assets = assets_directory()
    except DocsUnavailable as exc:
        if required:
            raise
        log.info("API documentation pages off (/openapi.json is served): %s", exc)
        return False
    script = _SCRIPT.read_bytes()  # package data: a wheel without it fails here, at start

    @app.get(SCRIPT_PATH, include_in_schema=False)
    async def page_script() -> Response:
        return Response(script, media_type="text/javascript", headers=_HEADERS)

    # After the script's route, which this mount would otherwise shadow.
    app.mount(ASSETS_PATH, StaticFiles(directory=assets), name="docs-assets")

    credential = None
    if dev_client is not None and is_loopback(dev_client.listen_host):
        credential = DEV_CREDENTIAL_PATH
        _install_dev_credential(app, dev_client)
    page = _page(signing=dev_client is not None, credential=credential)

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger() -> Response:
        return HTMLResponse(page, headers=_HEADERS)

    return True


def _install_dev_credential(app: FastAPI, dev_client: DevClient) -> None:
    @app.post(DEV_CREDENTIAL_PATH, include_in_schema=False)
    async def dev_credential(request: Request) -> Response:
        _check_page_request(request)
        secret = dev_client.secret_for(dev_client.client_id)
        if secret is None:  # removed from the clients file, or certificate-only
            raise HTTPException(404)
        log.info("development client credential given to the /docs page")
        return JSONResponse(
            {"client_id": dev_client.client_id, "secret": base64.b64encode(secret).decode()},
            headers=_NO_STORE,
        )


def _check_page_request(request: Request) -> None:
    """The caller is the /docs page in a browser on this machine: a loopback peer, a loopback
    Host (a rebinding name resolving to 127.0.0.1 is refused), and a same-origin fetch (the
    browser sets Sec-Fetch-Site and Origin; a page of another site cannot)."""
    peer = request.client.host if request.client is not None else ""
    host = request.headers.get("host", "")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    origin = f"{request.url.scheme}://{host}"
    if (
        not is_loopback(peer)
        or name.lower() not in _LOOPBACK_NAMES
        or request.headers.get("sec-fetch-site") != "same-origin"
        or request.headers.get("origin") != origin
    ):
        raise Forbidden(
            "the development credential is given to the /docs page only, opened on this "
            "machine as http(s)://127.0.0.1, localhost or [::1]"
        )


def _page(*, signing: bool, credential: str | None) -> str:
    config = {
        "openapi": OPENAPI_PATH,
        "signing": signing,
        "credential": credential,
    }
    # Inert data, not a script: "<" escaped so nothing in it can close the element.
    data = orjson.dumps(config).decode().replace("<", "\\u003c")
    panel = _SIGNER_PANEL if signing else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>cryptd API</title>
<link rel="stylesheet" href="{ASSETS_PATH}/swagger-ui.css">
<link rel="icon" type="image/png" href="{ASSETS_PATH}/favicon.png">
</head>
<body>
<script type="application/json" id="cryptd-docs-config">{data}</script>
{panel}<div id="swagger-ui"></div>
<script src="{ASSETS_PATH}/swagger-ui-bundle.js"></script>
<script src="{SCRIPT_PATH}"></script>
</body>
</html>
"""


_SIGNER_PANEL = """<section id="cryptd-signer" style="font-family: sans-serif; margin: 1em auto;
  max-width: 1400px; padding: 0 20px">
<p><strong>Development:</strong> "Try it out" signs requests to /v1/ in this browser.
<span id="cryptd-signer-status"></span></p>
<p><button type="button" id="cryptd-signer-load">Use the development client</button>
<button type="button" id="cryptd-signer-forget">Forget</button></p>
<form id="cryptd-signer-form" autocomplete="off">
<label>or client id <input id="cryptd-signer-id" value="dev" size="12"></label>
<label>secret (base64) <input id="cryptd-signer-secret" type="password" size="48"></label>
<button type="submit">Use</button>
</form>
</section>
"""
