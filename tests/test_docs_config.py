"""The documentation's switch: off in production unless CRYPTD_DOCS=true (on by default in
development, which tests/test_docs_page.py uses); only development's page signs, and only
there, to a same-origin page on loopback, is the development client's credential handed out."""

from __future__ import annotations

import base64
import fnmatch
import json
import re
import secrets
import tomllib
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

import service.api.docs
from service.api.application import create_app
from service.api.docs import DEV_CLIENT_ID, DEV_CREDENTIAL_PATH
from service.auth.clients import generate_secret, write_document
from service.config import Settings
from service.keys.admin import create_keyring_file
from service.keys.masterkey import MasterKey


def _app(
    tmp_path: Path,
    env: str,
    *,
    clients: Mapping[str, object] | None = None,
    peer: str = "127.0.0.1",
    base_url: str = "http://cryptd",
    settings: Mapping[str, object] | None = None,
) -> httpx.AsyncClient:
    """The real application, called in-process from ``peer`` (no lifespan: these requests
    touch no key)."""
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    create_keyring_file(tmp_path / "keyring.json", MasterKey(master))
    write_document(
        tmp_path / "clients.json",
        {"clients": clients or {"ops": {"secret": generate_secret(), "admin": True}}},
    )
    app = create_app(
        Settings(
            env=env,  # type: ignore[arg-type]
            tls="off",  # called in-process: no socket, no TLS to terminate
            master_key_file=tmp_path / "master.key",
            keyring_file=tmp_path / "keyring.json",
            clients_file=tmp_path / "clients.json",
            audit_log="off",
            **(settings or {}),  # type: ignore[arg-type]
        )
    )
    transport = httpx.ASGITransport(app=app, client=(peer, 50000))
    return httpx.AsyncClient(transport=transport, base_url=base_url)


def _production(tmp_path: Path, **settings: object) -> httpx.AsyncClient:
    return _app(tmp_path, "production", settings=settings)


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/docs-assets/swagger-ui.css"])
async def test_production_serves_no_docs_by_default(tmp_path: Path, path: str) -> None:
    async with _production(tmp_path) as http:
        answer = await http.get(path)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"


async def test_cryptd_docs_true_turns_them_on_in_production(tmp_path: Path) -> None:
    """Reference only: the page neither signs nor offers "Try it out", and there is no
    credential route, whatever the request."""
    async with _production(tmp_path, docs=True) as http:
        page = await http.get("/docs")
        assert page.status_code == 200
        assert _config(page.text) == {
            "openapi": "/openapi.json",
            "signing": False,
            "credential": None,
        }
        assert "cryptd-signer" not in page.text
        assert (await http.get("/openapi.json")).json()["openapi"] == "3.1.0"
        assert (await http.get("/docs-assets/swagger-ui-bundle.js")).status_code == 200
        assert (await http.get("/docs-assets/cryptd-docs.js")).status_code == 200
        refused = await http.post(DEV_CREDENTIAL_PATH, headers=_PAGE, content=b"{}")
        assert refused.status_code == 404
        assert "secret" not in refused.text


_DEV_SECRET = generate_secret()
_DEV_CLIENTS: dict[str, object] = {
    DEV_CLIENT_ID: {
        "secret": _DEV_SECRET,
        "admin": True,
        "allow": [{"keys": "*", "operations": ["*"]}],
    }
}
_ORIGIN = "http://127.0.0.1:8080"
# What Chromium sends with the page's fetch (tests/test_docs_page.py does it for real).
_PAGE = {"Sec-Fetch-Site": "same-origin", "Origin": _ORIGIN, "Content-Type": "application/json"}


def _config(page: str) -> object:
    match = re.search(
        r'<script type="application/json" id="cryptd-docs-config">(.*?)</script>', page
    )
    assert match is not None
    return json.loads(match.group(1))


def _development(tmp_path: Path, **settings: object) -> httpx.AsyncClient:
    return _app(tmp_path, "development", clients=_DEV_CLIENTS, base_url=_ORIGIN, settings=settings)


async def test_development_page_signs_with_its_own_script_only(tmp_path: Path) -> None:
    async with _development(tmp_path) as http:
        page = await http.get("/docs")
        script = await http.get("/docs-assets/cryptd-docs.js")
    assert _config(page.text) == {
        "openapi": "/openapi.json",
        "signing": True,
        "credential": DEV_CREDENTIAL_PATH,
    }
    assert 'id="cryptd-signer-load"' in page.text
    assert _DEV_SECRET not in page.text  # the secret comes only when the page asks
    # No inline script may run: the only scripts are files from this origin.
    policy = page.headers["content-security-policy"]
    assert "script-src 'self';" in policy
    assert re.findall(r"<script(?! type=\"application/json\")[^>]*>", page.text) == [
        '<script src="/docs-assets/swagger-ui-bundle.js">',
        '<script src="/docs-assets/cryptd-docs.js">',
    ]
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert "requestInterceptor" in script.text


async def test_development_credential_goes_to_the_page_on_loopback(tmp_path: Path) -> None:
    async with _development(tmp_path) as http:
        answer = await http.post(DEV_CREDENTIAL_PATH, headers=_PAGE, content=b"{}")
    assert answer.status_code == 200
    assert answer.json() == {"client_id": DEV_CLIENT_ID, "secret": _DEV_SECRET}
    assert answer.headers["cache-control"] == "no-store"


@pytest.mark.parametrize(
    ("peer", "headers"),
    [
        ("192.0.2.7", {}),  # from another machine
        ("127.0.0.1", {"Sec-Fetch-Site": None}),  # not a browser's fetch
        ("127.0.0.1", {"Sec-Fetch-Site": "cross-site"}),  # another site's page
        ("127.0.0.1", {"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:9999"}),
        ("127.0.0.1", {"Origin": "http://evil.example"}),
        # DNS rebinding: another site's name resolving to 127.0.0.1 is its own origin.
        (
            "127.0.0.1",
            {"Host": "evil.example:8080", "Origin": "http://evil.example:8080"},
        ),
    ],
)
async def test_development_credential_refused_to_anyone_else(
    tmp_path: Path, peer: str, headers: dict[str, str | None]
) -> None:
    sent = {**_PAGE, **headers}
    async with _app(
        tmp_path, "development", clients=_DEV_CLIENTS, peer=peer, base_url=_ORIGIN
    ) as http:
        answer = await http.post(
            DEV_CREDENTIAL_PATH,
            headers={k: v for k, v in sent.items() if v is not None},
            content=b"{}",
        )
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == "forbidden"
    assert _DEV_SECRET not in answer.text


async def test_no_credential_route_when_listening_beyond_loopback(tmp_path: Path) -> None:
    """Bound to every interface, the page still signs with a pasted credential, but the
    server hands out none, even to a loopback caller."""
    async with _development(tmp_path, host="0.0.0.0") as http:
        page = await http.get("/docs")
        answer = await http.post(DEV_CREDENTIAL_PATH, headers=_PAGE, content=b"{}")
    assert _config(page.text) == {"openapi": "/openapi.json", "signing": True, "credential": None}
    assert answer.status_code == 404


async def test_no_credential_without_the_development_client(tmp_path: Path) -> None:
    async with _app(tmp_path, "development", base_url=_ORIGIN) as http:  # only "ops"
        answer = await http.post(DEV_CREDENTIAL_PATH, headers=_PAGE, content=b"{}")
    assert answer.status_code == 404


def test_the_page_signs_as_the_client_serve_dev_creates() -> None:
    from service.cli.serve import DEV_CLIENT_ID as CREATED

    assert DEV_CLIENT_ID == CREATED


def test_the_page_script_is_package_data() -> None:
    """The wheel carries the script (setuptools package-data), not only the source tree."""
    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["service.api"]
    script = Path(service.api.docs.__file__).parent / "docs_static" / "cryptd-docs.js"
    assert script.is_file()
    assert any(fnmatch.fnmatch("docs_static/cryptd-docs.js", p) for p in patterns)


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
