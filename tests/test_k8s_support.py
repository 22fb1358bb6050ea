"""Helpers shared by the container and Kubernetes tests (this module holds no tests).

Tools the tests drive (kubectl, hadolint, shellcheck, redis-server) are looked up here once.
Where a tool is missing the test skips with the reason, except under CI=true, where a missing
tool is a failure: CI must install it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
VENV_BIN = Path(sys.executable).parent
IN_CI = os.environ.get("CI", "").lower() == "true"


def tool(name: str) -> str:
    """Path of a command-line tool (the venv's first), or skip / fail (CI) without it."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        message = f"{name} not installed (see docs/DEPLOY.md, 'Validation')"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


def load_docs(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in a file."""
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def parse_docs(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def cryptd_shim(bin_dir: Path) -> Path:
    """A `cryptd` command running this checkout's CLI with the test interpreter, so scripts
    that call `cryptd` work whether or not the project is pip-installed."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    return write_executable(
        bin_dir / "cryptd",
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from service.cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main())\n",
    )


def cli_available() -> bool:
    """True once the service's CLI imports (it is built in parallel with these manifests)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import service.cli.keys, service.cli.serve, service.api.application",
        ],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def require_cli() -> None:
    if not cli_available():
        message = "the cryptd application does not import yet"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def world_tempdir() -> Iterator[Path]:
    """A temporary directory every user may traverse, so a test can run a script as nobody."""
    path = Path(tempfile.mkdtemp(prefix="cryptd-k8s-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for sub in path.rglob("*"):
            if sub.is_dir() and not sub.is_symlink():
                sub.chmod(stat.S_IRWXU)
        shutil.rmtree(path)


# --- Secrets as make-secrets.sh builds them and the kubelet mounts them ---------------------------


def make_secrets(
    work: Path,
    master_key: Path,
    keyring: Path,
    clients: Path,
    redis_password: Path,
    tls: tuple[Path, Path, Path] | None = None,
) -> dict[str, dict[str, bytes]]:
    """Run k8s/scripts/make-secrets.sh; return {Secret name: {key: decoded bytes}}. ``tls``:
    (certificate chain, key, CA) for the cryptd-tls Secret cert-manager would otherwise make."""
    import base64

    kubectl = tool("kubectl")
    tls_args: list[str] = []
    if tls is not None:
        tls_args = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1]), "--tls-ca", str(tls[2])]
    result = subprocess.run(
        [
            str(K8S / "scripts" / "make-secrets.sh"),
            "--master-key",
            str(master_key),
            "--keyring",
            str(keyring),
            "--clients",
            str(clients),
            "--redis-password-file",
            str(redis_password),
            *tls_args,
        ],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{Path(kubectl).parent}{os.pathsep}{os.environ['PATH']}"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return {
        doc["metadata"]["name"]: {k: base64.b64decode(v) for k, v in doc["data"].items()}
        for doc in parse_docs(result.stdout)
    }


def publish_secret(mount: Path, files: dict[str, bytes], generation: int = 1) -> None:
    """Write a Secret volume the way the kubelet's atomic writer does: the files live in a
    timestamped directory, `..data` points at it, each key is a symlink through `..data`. An
    update writes a new directory and swaps `..data` with one rename."""
    mount.mkdir(parents=True, exist_ok=True)
    data_dir = mount / f"..2026_01_01_00_00_{generation:02d}.000000001"
    data_dir.mkdir()
    for name, content in files.items():
        (data_dir / name).write_bytes(content)
        (data_dir / name).chmod(0o440)
    link = mount / "..data"
    previous = link.resolve() if link.is_symlink() else None
    staging = mount / "..data_tmp"
    staging.symlink_to(data_dir.name)
    staging.rename(link)
    for name in files:
        if not (mount / name).is_symlink():
            (mount / name).symlink_to(f"..data/{name}")
    if previous is not None:
        shutil.rmtree(previous)


@contextlib.contextmanager
def redis_from_manifests(work: Path, users_acl: bytes) -> Iterator[int]:
    """redis-server with k8s/redis/redis.conf and the ACL make-secrets.sh built, on a free
    loopback port (only the paths, address and port differ from the pod). Yields the port."""
    server = tool("redis-server")
    port = free_port()
    (work / "acl").mkdir()
    (work / "acl" / "users.acl").write_bytes(users_acl)
    (work / "data").mkdir()
    conf = (K8S / "redis" / "redis.conf").read_text()
    replacements = {
        "include /etc/redis/acl/users.acl": f"include {work / 'acl' / 'users.acl'}",
        "bind * -::*": "bind 127.0.0.1",
        "port 6379": f"port {port}",
        "dir /data": f"dir {work / 'data'}",
    }
    for old, new in replacements.items():
        assert old in conf, old
        conf = conf.replace(old, new)
    (work / "redis.conf").write_text(conf)
    log = (work / "redis.log").open("wb")
    process = subprocess.Popen([server, str(work / "redis.conf")], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, (work / "redis.log").read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()
