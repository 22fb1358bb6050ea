"""The server on a read-only root filesystem, as in the pod (readOnlyRootFilesystem: true).

No container engine here, so the test builds the same situation with a private mount
namespace: the whole root filesystem is remounted read-only, tmpfs is mounted on the two
paths the Deployment mounts as emptyDirs (TMPDIR and PROMETHEUS_MULTIPROC_DIR), and the real
server starts through docker/entrypoint.sh in production mode with two workers. It must serve
signed requests (including SM2 through the system libcrypto) and drain on SIGTERM without
ever needing to write anywhere else. Needs root (mount namespaces); skips otherwise.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shlex
import signal
import ssl
import subprocess
import time

import httpx
import orjson
import pytest

from service.auth.signature import sign_request
from service.edge.devcerts import issue, make_ca
from tests.test_k8s_support import (
    IN_CI,
    ROOT,
    cryptd_shim,
    free_port,
    require_cli,
    tool,
    world_tempdir,
)

pytestmark = pytest.mark.slow


def _namespaces_usable() -> bool:
    probe = subprocess.run(
        [tool("unshare"), "--mount", "--propagation", "private", "true"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def _call(
    url: str, client: tuple[str, bytes], path: str, body: object, verify: ssl.SSLContext
) -> httpx.Response:
    content = orjson.dumps(body)
    headers = sign_request("POST", path, "", content, client[0], client[1])
    return httpx.post(url + path, content=content, headers=headers, timeout=30, verify=verify)


def test_server_runs_on_a_read_only_root_filesystem(redis_url: str) -> None:
    require_cli()
    if os.geteuid() != 0 or not _namespaces_usable():
        message = "needs root and mount namespaces (unshare --mount)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    with world_tempdir() as root:
        bin_dir = root / "bin"
        cryptd = str(cryptd_shim(bin_dir))
        secrets = root / "secrets"
        master = secrets / "master-key" / "master.key"
        keyring = secrets / "keyring" / "keyring.json"
        clients = secrets / "clients" / "clients.json"
        for path in (master, keyring, clients):
            path.parent.mkdir(parents=True)
        admin = [cryptd]
        subprocess.run([*admin, "master-key", "generate", "--out", str(master)], check=True)
        for name, key_type in (("payments", "aes256-gcm"), ("seal", "sm2")):
            subprocess.run(
                [
                    *admin,
                    "keys",
                    "create",
                    name,
                    "--type",
                    key_type,
                    "--keyring",
                    str(keyring),
                    "--master-key-file",
                    str(master),
                ],
                check=True,
                capture_output=True,
            )
        added = subprocess.run(
            [*admin, "clients", "add", "app", "--allow", "*:*", "--file", str(clients)],
            check=True,
            capture_output=True,
            text=True,
        )
        client = ("app", base64.b64decode(added.stdout.split()[0]))
        for leftover in secrets.rglob("*.lock"):
            leftover.unlink()
        # The TLS Secret (cert-manager's layout: tls.crt, tls.key, ca.crt).
        ca = make_ca("read-only test CA")
        server_cert = issue(ca, ["127.0.0.1"])
        tls_dir = secrets / "tls"
        tls_dir.mkdir()
        (tls_dir / "tls.crt").write_bytes(server_cert.cert_pem())
        (tls_dir / "tls.key").write_bytes(server_cert.key_pem())
        (tls_dir / "ca.crt").write_bytes(ca.cert_pem())
        verify = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
        for directory in ("tmp", "metrics", "work"):
            (root / directory).mkdir()

        port = free_port()
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": "/nonexistent",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": str(root / "tmp"),
            "PROMETHEUS_MULTIPROC_DIR": str(root / "metrics"),
            "CRYPTD_ENV": "production",
            "CRYPTD_HOST": "127.0.0.1",
            "CRYPTD_PORT": str(port),
            "CRYPTD_WORKERS": "2",  # several workers share their nonces through Redis
            "CRYPTD_REDIS_URL": redis_url,
            "CRYPTD_POOL_WORKERS": "2",
            "CRYPTD_MASTER_KEY_FILE": str(master),
            "CRYPTD_KEYRING_FILE": str(keyring),
            "CRYPTD_KEYRING_READ_ONLY": "true",
            # The keyring's directory is read-only (a Secret): usage counts go to the tmpfs,
            # as k8s/base has them in its emptyDir.
            "CRYPTD_USAGE_FILE": str(root / "tmp" / "usage" / "keyring.usage.sqlite"),
            "CRYPTD_CLIENTS_FILE": str(clients),
            "CRYPTD_TLS_CERT_FILE": str(tls_dir / "tls.crt"),
            "CRYPTD_TLS_KEY_FILE": str(tls_dir / "tls.key"),
        }
        q = shlex.quote
        script = "\n".join(
            [
                "set -e",
                "mount -o remount,bind,ro /",
                f"mount -t tmpfs -o size=64m,mode=1777 tmpfs {q(str(root / 'tmp'))}",
                f"mount -t tmpfs -o size=64m,mode=0700 tmpfs {q(str(root / 'metrics'))}",
                f"if touch {q(str(root / 'work' / 'probe'))} 2>/dev/null; then",
                "  echo 'root filesystem still writable' >&2; exit 97",
                "fi",
                f"cd {q(str(root / 'work'))}",
                "exec env -i "
                + " ".join(f"{k}={q(v)}" for k, v in env.items())
                + f" /bin/bash {q(str(ROOT / 'docker' / 'entrypoint.sh'))}",
            ]
        )
        log_path = root / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [tool("unshare"), "--mount", "--propagation", "private", "/bin/bash", "-c", script],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"https://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/readyz", timeout=1, verify=verify).status_code == 200:
                        break
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
                time.sleep(0.2)

            plaintext = base64.b64encode(b"read-only root").decode()
            sealed = _call(url, client, "/v1/encrypt/payments", {"plaintext": plaintext}, verify)
            assert sealed.status_code == 200, sealed.text
            opened = _call(url, client, "/v1/decrypt/payments", sealed.json(), verify)
            assert opened.status_code == 200, opened.text
            assert opened.json()["plaintext"] == plaintext
            signed = _call(url, client, "/v1/sign/seal", {"message": plaintext}, verify)
            assert signed.status_code == 200, signed.text
            verified = _call(
                url,
                client,
                "/v1/verify/seal",
                {"message": plaintext, "signature": signed.json()["signature"]},
                verify,
            )
            assert verified.json() == {"valid": True}
            # Key management would have to write the keyring: refused, not attempted.
            refused = _call(url, client, "/v1/keys/other", {"type": "aes256-gcm"}, verify)
            assert refused.status_code in (403, 409), refused.text

            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=40) == 0, log_path.read_text(errors="replace")[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        log_text = log_path.read_text(errors="replace")
        assert "Read-only file system" not in log_text, log_text[-3000:]
        assert "Finished server process" in log_text
        assert list((root / "work").iterdir()) == []
