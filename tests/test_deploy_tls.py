"""docs/DEPLOY.md's recipe for a TLS certificate outside Kubernetes, run as written with
``openssl``; ``cryptd serve --check`` accepts the result and a production server of two
workers serves it, verified by a client trusting only the recipe's CA for the recipe's name.
Also the start line: mode, workers, TLS subject and expiry, master key, stores, audit."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow  # runs openssl and a server

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- test: tls-recipe -->"
SERVER_NAME = "cryptd.example.internal"


def recipe() -> str:
    """The fenced block right after the marker in docs/DEPLOY.md."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    found = re.search(re.escape(MARKER) + r"\n```sh\n(.*?)\n```", text, re.DOTALL)
    assert found, f"{MARKER} followed by a sh block not found in docs/DEPLOY.md"
    return found.group(1)


def _cryptd(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _production_env(directory: Path) -> dict[str, str]:
    """Master key, an empty keyring and one client made with cryptd's own commands."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    env = {
        **base,
        "CRYPTD_MASTER_KEY_FILE": str(directory / "master.key"),
        "CRYPTD_KEYRING_FILE": str(directory / "keyring.json"),
        "CRYPTD_CLIENTS_FILE": str(directory / "clients.json"),
    }
    for command in (
        ("master-key", "generate", "--out", "master.key"),
        ("keystore", "init"),
        ("clients", "add", "app", "--allow", "*:encrypt", "--file", "clients.json"),
    ):
        done = _cryptd(*command, env=env, cwd=directory)
        assert done.returncode == 0, done.stderr
    return env


def _get_healthz(port: int, ca_file: Path) -> int:
    """GET /healthz over TLS to 127.0.0.1, verifying the certificate for SERVER_NAME."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=SERVER_NAME) as tls,
    ):
        tls.sendall(f"GET /healthz HTTP/1.1\r\nHost: {SERVER_NAME}\r\n\r\n".encode())
        response = http.client.HTTPResponse(tls)
        response.begin()
        return response.status


def test_the_deploy_recipe_makes_a_certificate_cryptd_serves_in_production(
    tmp_path: Path,
) -> None:
    assert shutil.which("openssl"), "openssl is needed (Debian package openssl)"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", recipe()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "server.crt: OK" in done.stdout
    assert (tmp_path / "server.key").stat().st_mode & 0o077 == 0
    env = {
        **_production_env(tmp_path),
        "CRYPTD_TLS_CERT_FILE": str(tmp_path / "server.crt"),
        "CRYPTD_TLS_KEY_FILE": str(tmp_path / "server.key"),
        "CRYPTD_WORKERS": "2",
    }
    checked = _cryptd("serve", "--check", env=env, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "configuration OK" in checked.stderr
    assert f"tls subject CN={SERVER_NAME}" in checked.stderr

    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        status = None
        while status != 200:
            assert server.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            with contextlib.suppress(OSError):
                status = _get_healthz(port, tmp_path / "ca.crt")
            time.sleep(0.2)
        # A client that does not trust the recipe's CA is refused at the handshake.
        with (
            pytest.raises(ssl.SSLCertVerificationError),
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ):
            ssl.create_default_context().wrap_socket(raw, server_hostname=SERVER_NAME)
    finally:
        server.terminate()
        server.wait(timeout=60)
    records = [
        orjson.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")
    ]
    starting: list[dict[str, Any]] = [r for r in records if r["msg"] == "cryptd starting"]
    assert len(starting) == 1, records
    line = starting[0]
    assert line["mode"] == "production"
    assert line["workers"] == 2
    assert line["tls"] == "on"
    assert line["tls_subject"] == f"CN={SERVER_NAME}"
    left = datetime.datetime.fromisoformat(line["tls_not_after"]) - datetime.datetime.now(
        datetime.UTC
    )
    assert datetime.timedelta(days=89) < left <= datetime.timedelta(days=90)
    assert line["master_key"] == f"CRYPTD_MASTER_KEY_FILE {tmp_path / 'master.key'}"
    assert line["key_store"].startswith("file ")
    assert line["replay_store"].startswith("host directory ")
    assert line["audit"] == "stderr"
    assert len([r for r in records if r["msg"] == "TLS certificate loaded"]) == 2
