"""The documentation's switch: off in production unless CRYPTD_DOCS=true (on by default in
development, which tests/test_docs_page.py uses)."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import httpx
import pytest

from service.api.application import create_app
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


@pytest.mark.slow
def test_serve_with_docs_true_without_the_extra_fails_once_before_any_worker(
    tmp_path: Path,
) -> None:
    """``cryptd serve`` with CRYPTD_DOCS=true where fastapi-offline cannot be imported (a
    package of that name ahead on the path that raises ImportError): one error line naming
    the extra, exit status 2, before any worker starts (no traceback)."""
    import os
    import subprocess
    import sys

    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    create_keyring_file(tmp_path / "keyring.json", MasterKey(master))
    write_document(tmp_path / "clients.json", {"clients": {"ops": {"secret": generate_secret()}}})
    shadow = tmp_path / "shadow" / "fastapi_offline"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("fastapi-offline is not installed")\n')
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(root)]),
        "CRYPTD_ENV": "production",
        "CRYPTD_TLS": "off",
        "CRYPTD_MASTER_KEY_FILE": str(tmp_path / "master.key"),
        "CRYPTD_KEYRING_FILE": str(tmp_path / "keyring.json"),
        "CRYPTD_CLIENTS_FILE": str(tmp_path / "clients.json"),
        "CRYPTD_AUDIT_LOG": "off",
        "CRYPTD_WORKERS": "2",
        "CRYPTD_DOCS": "true",
    }
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "cryptd: error: CRYPTD_DOCS=true: the documentation pages need their assets: "
        "pip install 'cryptd[docs]'"
    ]
