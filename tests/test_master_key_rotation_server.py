"""Master-key rotation of a running server (two workers), from outside: through the admin
route and through ``cryptd operator rotate-master-key``, under a steady encrypt/decrypt load
that sees no failure; afterwards every worker serves and changes keys under the new key."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from service.auth.clients import generate_secret, write_document
from service.keys.masterkey import MasterKey
from tests.conftest import Server, connections_to_every_worker, start_server, stop_server

pytestmark = pytest.mark.slow


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Load(threading.Thread):
    """Encrypt then decrypt, on new connections (every worker in turn), until stopped."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stopping = threading.Event()
        self.done = 0
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stopping.is_set():
            text = secrets.token_bytes(16)
            try:
                sealed = self.server.request(
                    "POST", "/v1/encrypt/aes256-gcm", {"plaintext": _b64(text)}
                )
                if sealed.status_code != 200:
                    self.failures.append(f"encrypt {sealed.status_code} {sealed.text[:200]}")
                    continue
                opened = self.server.request(
                    "POST", "/v1/decrypt/aes256-gcm", {"ciphertext": sealed.json()["ciphertext"]}
                )
                if (
                    opened.status_code != 200
                    or base64.b64decode(opened.json()["plaintext"]) != text
                ):
                    self.failures.append(f"decrypt {opened.status_code} {opened.text[:200]}")
                    continue
            except httpx.HTTPError as exc:
                self.failures.append(f"transport {type(exc).__name__}")
                continue
            self.done += 1


def _key_id(path: Path) -> str:
    return MasterKey(base64.b64decode(path.read_text().strip())).key_id


def test_rotation_online_on_every_worker(tmp_path: Path) -> None:
    # The development state made beforehand, with a second, non-admin client.
    state = tmp_path / "dev"
    state.mkdir(mode=0o700)
    master_file = state / "master.key"
    master_file.write_bytes(base64.b64encode(secrets.token_bytes(32)) + b"\n")
    master_file.chmod(0o600)
    admin_secret, reader_secret = generate_secret(), generate_secret()
    write_document(
        state / "clients.json",
        {
            "clients": {
                "dev": {
                    "secret": admin_secret,
                    "admin": True,
                    "allow": [{"keys": "*", "operations": ["*"]}],
                },
                "reader": {
                    "secret": reader_secret,
                    "allow": [{"keys": "*", "operations": ["encrypt", "decrypt"]}],
                },
            }
        },
    )
    server = start_server(tmp_path, workers=2)
    try:
        old = _key_id(master_file)
        before = server.request(
            "POST", "/v1/encrypt/aes256-gcm", {"plaintext": _b64(b"before")}
        ).json()["ciphertext"]
        backup = server.request("GET", "/v1/keys/aes256-gcm/backup")
        assert backup.status_code == 200, backup.text

        # Not an admin: 403, nothing written.
        refused = server.request(
            "POST",
            "/v1/sys/rotate-master-key",
            client_id="reader",
            secret=base64.b64decode(reader_secret),
        )
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
        bad = server.request("POST", "/v1/sys/rotate-master-key", {"force": True})
        assert bad.status_code == 400, bad.text
        assert _key_id(master_file) == old

        load = Load(server)
        load.start()
        try:
            # Through the route.
            answer = server.request("POST", "/v1/sys/rotate-master-key")
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["previous_master_key_id"] == old
            assert body["master_key_id"] == _key_id(master_file) != old
            assert body["versions"] >= 19
            middle = body["master_key_id"]
            # Through the CLI, from outside the server.
            env = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
            env.update(
                CRYPTD_MASTER_KEY_FILE=str(master_file),
                CRYPTD_KEYRING_FILE=str(state / "keyring.json"),
            )
            cli = subprocess.run(
                [sys.executable, "-m", "service", "operator", "rotate-master-key"],
                env=env,
                capture_output=True,
                timeout=120,
            )
            assert cli.returncode == 0, cli.stderr.decode()[-2000:]
            report = orjson.loads(cli.stdout)
            assert report["previous_master_key_id"] == middle
            assert report["master_key_id"] == _key_id(master_file)
        finally:
            # The load goes on past the rotation until it has made its pairs: a fast rotation
            # leaves fewer of them during it, not a weaker check of the ones after.
            deadline = time.monotonic() + 30
            while load.done <= 10 and not load.failures and time.monotonic() < deadline:
                time.sleep(0.1)
            load.stopping.set()
            load.join(timeout=30)
        assert load.failures == []
        print(f"load: {load.done} encrypt+decrypt pairs")  # shown with -s
        assert load.done > 10

        # Every worker moved: each changes a key (wrapped under the new key) and decrypts.
        with connections_to_every_worker(server, 2) as workers:
            for connection in workers.values():
                rotated = server.request(
                    "POST", "/v1/keys/aes256-gcm/rotate", connection=connection
                )
                assert rotated.status_code == 200, rotated.text
                opened = server.request(
                    "POST",
                    "/v1/decrypt/aes256-gcm",
                    {"ciphertext": before},
                    connection=connection,
                )
                assert opened.status_code == 200, opened.text
                ready = connection.get("/readyz")
                assert ready.status_code == 200, ready.text

        # A backup made under the first key restores after two rotations (into its own
        # name: the key is deleted first, which development keys allow).
        assert server.request("DELETE", "/v1/keys/aes256-gcm").status_code in (200, 204)
        restored = server.request(
            "POST", "/v1/keys/aes256-gcm/restore", {"backup": backup.json()["backup"]}
        )
        assert restored.status_code == 201, restored.text
        opened = server.request("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": before})
        assert opened.status_code == 200, opened.text
        assert base64.b64decode(opened.json()["plaintext"]) == b"before"

        retired = Path(str(master_file) + ".retired").read_text().split()
        assert len(retired) == 2
        log = server.log()
        assert "sys.rotate-master-key" in log
        for line in log.splitlines():  # no key in the log, old or new
            assert master_file.read_text().strip() not in line
            assert all(key not in line for key in retired)
    finally:
        stop_server(server)


def test_rotation_reaches_every_worker_of_both_replicas(
    tmp_path: Path, pg_database: str, redis_url: str
) -> None:
    """Two replicas (two workers each) on one PostgreSQL store, reading one key file (here a
    symlink to the first replica's, as a shared volume would be)."""
    env = {"CRYPTD_KEYSTORE_URL": pg_database, "CRYPTD_REDIS_URL": redis_url}
    first = start_server(tmp_path / "replica-0", env, workers=2)
    servers = [first]
    try:
        state = tmp_path / "replica-1" / "dev"
        state.mkdir(parents=True, mode=0o700)
        (state / "master.key").symlink_to(tmp_path / "replica-0" / "dev" / "master.key")
        (state / "clients.json").write_bytes(
            (tmp_path / "replica-0" / "dev" / "clients.json").read_bytes()
        )
        second = start_server(tmp_path / "replica-1", env, workers=2)
        servers.append(second)
        before = first.request(
            "POST", "/v1/encrypt/aes256-gcm", {"plaintext": _b64(b"before")}
        ).json()["ciphertext"]
        loads = [Load(server) for server in servers]
        for load in loads:
            load.start()
        try:
            answer = second.request("POST", "/v1/sys/rotate-master-key")
            assert answer.status_code == 200, answer.text
        finally:
            for load in loads:
                load.stopping.set()
                load.join(timeout=30)
        for load in loads:
            assert load.failures == []
        key_file = tmp_path / "replica-0" / "dev" / "master.key"
        assert (state / "master.key").is_symlink()
        assert _key_id(key_file) == answer.json()["master_key_id"]
        for server in servers:
            with connections_to_every_worker(server, 2) as workers:
                for connection in workers.values():
                    rotated = server.request(
                        "POST", "/v1/keys/aes256-gcm/rotate", connection=connection
                    )
                    assert rotated.status_code == 200, rotated.text
                    opened = server.request(
                        "POST",
                        "/v1/decrypt/aes256-gcm",
                        {"ciphertext": before},
                        connection=connection,
                    )
                    assert opened.status_code == 200, opened.text
    finally:
        for server in servers:
            stop_server(server)
