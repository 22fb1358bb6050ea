"""The examples for other languages (examples/curl, examples/go, examples/java) run against a
live server: each checks itself against the known-answer vector, then signs, encrypts,
decrypts, signs and verifies. The tools are Debian's (bash/curl/openssl, golang, JDK 17)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.slow
STEPS = ("known-answer vector: ok", "encrypt: cryptd:v", "decrypt: ok", "sign: ", "verify: ok")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required under CI (.ci/run installs it)")
        pytest.skip(f"{name} is not installed")
    return found


def _run(server: Server, command: list[str], cwd: Path, tmp_path: Path, **env: str) -> str:
    environ = {
        **os.environ,
        "CRYPTD_URL": server.url,
        "CRYPTD_CLIENT_ID": server.client_id,
        "CRYPTD_SECRET": base64.b64encode(server.secret).decode(),
        "GOCACHE": str(tmp_path / "gocache"),
        "GOPATH": str(tmp_path / "gopath"),
        "GOFLAGS": "-mod=mod",
        "GOTOOLCHAIN": "local",
        **env,
    }
    done = subprocess.run(
        command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for step in STEPS:
        assert step in done.stdout, done.stdout
    return done.stdout


def test_curl_example(server: Server, tmp_path: Path) -> None:
    for tool in ("bash", "curl", "openssl"):
        _tool(tool)
    _run(server, ["bash", str(EXAMPLES / "curl" / "cryptd.sh")], tmp_path, tmp_path)


def test_go_example(server: Server, tmp_path: Path) -> None:
    go = _tool("go")
    _run(server, [go, "run", "."], EXAMPLES / "go", tmp_path)


def test_java_example(server: Server, tmp_path: Path) -> None:
    java = _tool("java")
    # java.net.http on its defaults: HTTP/2 preferred, so it offers "Upgrade: h2c" over http://.
    _run(server, [java, str(EXAMPLES / "java" / "CryptdExample.java")], tmp_path, tmp_path)


def test_examples_refuse_a_wrong_secret(server: Server, tmp_path: Path) -> None:
    _tool("curl")
    environ = {
        **os.environ,
        "CRYPTD_URL": server.url,
        "CRYPTD_CLIENT_ID": server.client_id,
        "CRYPTD_SECRET": "d3Jvbmctc2VjcmV0LXdyb25nLXNlY3JldC13cm9uZyE=",
    }
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
