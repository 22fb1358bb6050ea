"""The documentation's switch: off in production unless CRYPTD_DOCS=true (on by default in
development, which tests/test_docs_page.py uses)."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.auth.clients import generate_secret, write_document
from service.config import Settings
from service.keys.admin import create_keyring_file
from service.keys.masterkey import MasterKey


def _production(tmp_path: Path, **settings: object) -> httpx.AsyncClient:
    """The real application in production mode, called in-process (no lifespan: these
    requests touch no key)."""
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    create_keyring_file(tmp_path / "keyring.json", MasterKey(master))
    write_document(tmp_path / "clients.json", {"clients": {"ops": {"secret": generate_secret()}}})
    app = create_app(
        Settings(
            env="production",
            tls="off",  # called in-process: no socket, no TLS to terminate
            master_key_file=tmp_path / "master.key",
            keyring_file=tmp_path / "keyring.json",
            clients_file=tmp_path / "clients.json",
            audit_log="off",
            **settings,  # type: ignore[arg-type]
        )
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cryptd")


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/docs-assets/swagger-ui.css"])
async def test_production_serves_no_docs_by_default(tmp_path: Path, path: str) -> None:
    async with _production(tmp_path) as http:
        answer = await http.get(path)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"


async def test_cryptd_docs_true_turns_them_on_in_production(tmp_path: Path) -> None:
    async with _production(tmp_path, docs=True) as http:
        assert (await http.get("/docs")).status_code == 200
        assert (await http.get("/openapi.json")).json()["openapi"] == "3.1.0"
        assert (await http.get("/docs-assets/swagger-ui-bundle.js")).status_code == 200


def test_docs_true_without_the_assets_package_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from service.api.docs import DocsUnavailable

    monkeypatch.setitem(sys.modules, "fastapi_offline", None)  # as if not installed
    with pytest.raises(DocsUnavailable, match="cryptd\\[docs\\]"):
        _production(tmp_path, docs=True)
