"""The examples for other languages (examples/curl, examples/go, examples/java) run against a
live server over HTTPS with a private CA (``cryptd serve --dev --tls``), reading the
development credential file (client.json and the CA it names): each checks itself against the
known-answer vector, then signs, encrypts, decrypts, signs and verifies. Each run starts in a
replay store's restart window (its Redis epoch deleted, as a restart does), so its first
request gets a real 503 with Retry-After and must sign again after the wait. The tools are
Debian's (bash/curl/openssl, golang, JDK 17)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server, stop_server
from tests.test_client_retry import reopen_replay_window, start_recovering_server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.slow
STEPS = ("known-answer vector: ok", "encrypt: cryptd:v", "decrypt: ok", "sign: ", "verify: ok")
RETRIED = "answered 503: retrying in"


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[tuple[Server, str]]:
    server, url = start_recovering_server(tmp_path_factory.mktemp("examples"), redis_url)
    yield server, url
    stop_server(server)
    reopen_replay_window(url)


def _credential(server: Server) -> Path:
    path = server.directory / "dev" / "client.json"
    credential = json.loads(path.read_text())
    assert credential["url"].startswith("https://")
    assert Path(credential["ca_file"]).is_file()
    return path


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required under CI (.ci/run installs it)")
        pytest.skip(f"{name} is not installed")
    return found


def _environ(tmp_path: Path, **env: str) -> dict[str, str]:
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("CRYPTD_") and name not in ("SSL_CERT_FILE", "SSL_CERT_DIR")
    }
    return {
        **inherited,
        "GOCACHE": str(tmp_path / "gocache"),
        "GOPATH": str(tmp_path / "gopath"),
        "GOFLAGS": "-mod=mod",
        "GOTOOLCHAIN": "local",
        **env,
    }


def _run(
    tls_server: tuple[Server, str], command: list[str], cwd: Path, tmp_path: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run an example at the start of a replay-store window; it must retry and succeed."""
    _, url = tls_server
    reopen_replay_window(url)
    done = subprocess.run(
        command,
        cwd=cwd,
        env=_environ(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for step in STEPS:
        assert step in done.stdout, done.stdout
    assert RETRIED in done.stderr, done.stderr  # a real 503 + Retry-After, signed again
    return done


def test_curl_example_with_credential_file(tls_server: tuple[Server, str], tmp_path: Path) -> None:
    for tool in ("bash", "curl", "openssl"):
        _tool(tool)
    credential = _credential(tls_server[0])
    script = str(EXAMPLES / "curl" / "cryptd.sh")
    _run(tls_server, ["bash", script], tmp_path, tmp_path, CRYPTD_CREDENTIAL=str(credential))


def test_curl_example_with_variables_and_ca_file(
    tls_server: tuple[Server, str], tmp_path: Path
) -> None:
    _tool("curl")
    server = tls_server[0]
    assert server.ca_file is not None
    variables = {
        "CRYPTD_URL": server.url,
        "CRYPTD_CLIENT_ID": server.client_id,
        "CRYPTD_SECRET": base64.b64encode(server.secret).decode(),
    }
    script = ["bash", str(EXAMPLES / "curl" / "cryptd.sh")]
    _run(tls_server, script, tmp_path, tmp_path, CRYPTD_CA_FILE=str(server.ca_file), **variables)
    # Without the private CA the server's certificate is not trusted: no request gets through.
    done = subprocess.run(
        script, env=_environ(tmp_path, **variables), capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "certificate" in done.stderr.lower()
    assert "encrypt:" not in done.stdout


def test_go_example(tls_server: tuple[Server, str], tmp_path: Path) -> None:
    go = _tool("go")
    credential = str(_credential(tls_server[0]))
    done = _run(
        tls_server, [go, "run", "."], EXAMPLES / "go", tmp_path, CRYPTD_CREDENTIAL=credential
    )
    assert "kem: ok (1120-byte ciphertext)" in done.stdout  # X-Wing: 1,088 + 32 bytes


def test_java_example(tls_server: tuple[Server, str], tmp_path: Path) -> None:
    java = _tool("java")
    credential = str(_credential(tls_server[0]))
    source = str(EXAMPLES / "java" / "CryptdExample.java")
    done = _run(tls_server, [java, source], tmp_path, tmp_path, CRYPTD_CREDENTIAL=credential)
    assert "ml-dsa: ok (3309-byte signature)" in done.stdout  # FIPS 204 ML-DSA-65


def test_java_example_over_http(server: Server, tmp_path: Path) -> None:
    # java.net.http on its defaults: HTTP/2 preferred, so it offers "Upgrade: h2c" over http://.
    java = _tool("java")
    done = subprocess.run(
        [java, str(EXAMPLES / "java" / "CryptdExample.java")],
        env=_environ(
            tmp_path,
            CRYPTD_URL=server.url,
            CRYPTD_CLIENT_ID=server.client_id,
            CRYPTD_SECRET=base64.b64encode(server.secret).decode(),
        ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify: ok" in done.stdout


def test_examples_refuse_a_wrong_secret(server: Server, tmp_path: Path) -> None:
    _tool("curl")
    environ = _environ(
        tmp_path,
        CRYPTD_URL=server.url,
        CRYPTD_CLIENT_ID=server.client_id,
        CRYPTD_SECRET="d3Jvbmctc2VjcmV0LXdyb25nLXNlY3JldC13cm9uZyE=",
    )
    done = subprocess.run(
        ["bash", str(EXAMPLES / "curl" / "cryptd.sh")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "answered 401" in done.stderr
