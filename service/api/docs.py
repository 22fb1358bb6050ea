"""API documentation that works without internet: ``/openapi.json`` and Swagger UI at ``/docs``,
its scripts and styles served from the ``fastapi-offline`` package (the ``docs`` extra), never
from a CDN; the page's Content-Security-Policy lets it reach this origin only. (No Redoc: its
standalone build always loads a logo from its vendor's CDN.) Off unless ``CRYPTD_DOCS=true``;
development turns them on by default when the extra is installed. Unsigned, as documentation
is.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from service.api.openapi import build_document

log = logging.getLogger("cryptd.api")

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
ASSETS_PATH = "/docs-assets"
# The page may load and connect to this origin only: nothing leaves the host.
_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}


class DocsUnavailable(RuntimeError):
    """CRYPTD_DOCS is on but the assets package is not installed."""


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


def install(app: FastAPI, *, enabled: bool, required: bool) -> bool:
    """Serve the document and the pages if ``enabled``; without the assets package that is an
    error when ``required`` (CRYPTD_DOCS=true), else the pages stay off. Returns whether the
    pages are served."""
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
    app.mount(ASSETS_PATH, StaticFiles(directory=assets), name="docs-assets")

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger(request: Request) -> Response:
        page = get_swagger_ui_html(
            openapi_url=OPENAPI_PATH,
            title="cryptd API",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None, "tryItOutEnabled": False},
        )
        return HTMLResponse(page.body, headers=_HEADERS)

    return True
