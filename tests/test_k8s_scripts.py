"""The operator scripts in k8s/scripts, run for real: make-secrets.sh renders the Secrets with
kubectl (offline, --dry-run=client), rotate-key.sh rotates a key with the real `cryptd keys`
CLI. Only `kubectl apply` and `kubectl get secret`, which need a cluster, are stood in for."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests.test_k8s_support import (
    K8S,
    cryptd_shim,
    make_secrets,
    parse_docs,
    require_cli,
    tool,
    world_tempdir,
    write_executable,
)

pytestmark = pytest.mark.slow  # the operator scripts run for real

MAKE_SECRETS = K8S / "scripts" / "make-secrets.sh"
ROTATE = K8S / "scripts" / "rotate-key.sh"


@pytest.fixture
def work() -> Iterator[Path]:
    with world_tempdir() as path:
        yield path


def _inputs(work: Path) -> tuple[Path, Path, Path]:
    master = work / "master.key"
    master.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    keyring = work / "keyring.json"
    keyring.write_text('{"keys": {}}')
    clients = work / "clients.json"
    clients.write_text('{"clients": {}}')
    return master, keyring, clients


def _run(
    script: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(script), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


# --- make-secrets.sh ------------------------------------------------------------------------------


def test_make_secrets_renders_the_four_secrets(work: Path) -> None:
    master, keyring, clients = _inputs(work)
    secrets = make_secrets(work, master, keyring, clients, work / "redis-password")
    assert set(secrets) == {"cryptd-master-key", "cryptd-keyring", "cryptd-clients", "cryptd-redis"}
    assert secrets["cryptd-master-key"] == {"master.key": master.read_bytes()}
    assert secrets["cryptd-keyring"] == {"keyring.json": keyring.read_bytes()}
    assert secrets["cryptd-clients"] == {"clients.json": clients.read_bytes()}
    assert set(secrets["cryptd-redis"]) == {"url", "users.acl"}
    password = (work / "redis-password").read_text()
    assert (
        secrets["cryptd-redis"]["url"] == f"redis://cryptd:{password}@cryptd-redis:6379/0".encode()
    )
    assert stat.S_IMODE((work / "redis-password").stat().st_mode) == 0o600


def test_make_secrets_output_is_valid_and_namespaced(work: Path) -> None:
    master, keyring, clients = _inputs(work)
    result = _run(
        MAKE_SECRETS,
        "--master-key",
        str(master),
        "--keyring",
        str(keyring),
        "--clients",
        str(clients),
        "--redis-password-file",
        str(work / "pw"),
        "--namespace",
        "cryptd",
        env={**os.environ, "PATH": f"{Path(tool('kubectl')).parent}:{os.environ['PATH']}"},
    )
    assert result.returncode == 0, result.stderr
    docs = parse_docs(result.stdout)
    assert len(docs) == 4
    for doc in docs:
        kubernetes_validate.validate(doc, "1.29.0", strict=True)
        assert doc["metadata"]["namespace"] == "cryptd"
    # Secret material goes to stdout only, never to the diagnostics.
    assert master.read_text().strip() not in result.stderr


def test_make_secrets_keeps_the_redis_password(work: Path) -> None:
    master, keyring, clients = _inputs(work)
    first = make_secrets(work, master, keyring, clients, work / "pw")
    second = make_secrets(work, master, keyring, clients, work / "pw")
    assert first["cryptd-redis"] == second["cryptd-redis"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (base64.b64encode(os.urandom(16)).decode(), "must decode to 32 bytes"),
        ("", "missing, unreadable or empty"),
    ],
)
def test_make_secrets_refuses_a_bad_master_key(work: Path, content: str, message: str) -> None:
    master, keyring, clients = _inputs(work)
    master.write_text(content)
    result = _run(
        MAKE_SECRETS,
        "--master-key",
        str(master),
        "--keyring",
        str(keyring),
        "--clients",
        str(clients),
        "--redis-password-file",
        str(work / "pw"),
    )
    assert result.returncode == 1
    assert message in result.stderr
    assert result.stdout == ""


def test_make_secrets_needs_every_input(work: Path) -> None:
    master, keyring, _ = _inputs(work)
    result = _run(MAKE_SECRETS, "--master-key", str(master), "--keyring", str(keyring))
    assert result.returncode == 64
    assert "usage:" in result.stderr


# --- rotate-key.sh --------------------------------------------------------------------------------


class Operator:
    """An operator's workstation: the cryptd CLI, kubectl (create runs for real; apply and get
    are recorded and answered here, as a cluster would), a master key and a keyring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        cryptd_shim(self.bin)
        self.applied = root / "applied.yaml"
        self.cluster_secret = root / "cluster-keyring.b64"
        real = tool("kubectl")
        write_executable(
            self.bin / "kubectl",
            "#!/bin/bash\n"
            'case "$1" in\n'
            f'  apply) cp -- "$3" {self.applied} ;;\n'
            f"  get) cat -- {self.cluster_secret} ;;\n"
            f'  *) exec {real} "$@" ;;\n'
            "esac\n",
        )
        self.master = root / "master.key"
        self.keyring = root / "keyring.json"
        self.clients = root / "clients.json"
        self.clients.write_text('{"clients": {}}\n')
        self.cryptd("master-key", "generate", "--out", str(self.master))
        self.cryptd(
            "keys",
            "create",
            "payments",
            "--type",
            "aes256-gcm",
            "--keyring",
            str(self.keyring),
            "--master-key-file",
            str(self.master),
        )

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}"}

    def cryptd(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.bin / "cryptd"), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def latest_version(self, keyring: Path) -> int:
        shown = json.loads(
            self.cryptd(
                "keys",
                "show",
                "payments",
                "--keyring",
                str(keyring),
                "--master-key-file",
                str(self.master),
            )
        )
        version: int = shown["latest_version"]
        return version

    def rotate(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _run(ROTATE, "payments", "--master-key", str(self.master), *args, env=self.env)


@pytest.fixture
def operator(work: Path) -> Operator:
    require_cli()
    return Operator(work)


def _keyring_in(secret_yaml: str, root: Path) -> Path:
    [doc] = parse_docs(secret_yaml)
    kubernetes_validate.validate(doc, "1.29.0", strict=True)
    assert doc["metadata"]["name"] == "cryptd-keyring"
    path = root / f"from-secret-{os.urandom(4).hex()}.json"
    path.write_bytes(base64.b64decode(doc["data"]["keyring.json"]))
    return path


def test_rotate_updates_the_secure_copy_then_applies_the_secret(operator: Operator) -> None:
    before = operator.keyring.read_bytes()
    assert operator.latest_version(operator.keyring) == 1
    result = operator.rotate("--keyring", str(operator.keyring), "--namespace", "cryptd")
    assert result.returncode == 0, result.stderr
    assert operator.latest_version(operator.keyring) == 2
    backups = list(operator.root.glob("keyring.json.*.bak"))
    assert len(backups) == 1
    assert backups[0].read_bytes() == before
    applied = operator.applied.read_text()
    assert "namespace: cryptd" in applied
    assert _keyring_in(applied, operator.root).read_bytes() == operator.keyring.read_bytes()


def test_rotate_dry_run_prints_the_secret_and_writes_nothing(operator: Operator) -> None:
    before = operator.keyring.read_bytes()
    result = operator.rotate("--keyring", str(operator.keyring), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert operator.keyring.read_bytes() == before
    assert not operator.applied.exists()
    assert not list(operator.root.glob("*.bak"))
    assert operator.latest_version(_keyring_in(result.stdout, operator.root)) == 2


def test_rotate_from_the_cluster_keeps_a_copy(operator: Operator) -> None:
    operator.cluster_secret.write_text(base64.b64encode(operator.keyring.read_bytes()).decode())
    out = operator.root / "rotated.json"
    refused = operator.rotate("--from-cluster")
    assert refused.returncode == 1
    assert "--out" in refused.stderr
    result = operator.rotate("--from-cluster", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert operator.latest_version(out) == 2
    assert _keyring_in(operator.applied.read_text(), operator.root).read_bytes() == out.read_bytes()


def test_rotate_with_the_wrong_master_key_changes_nothing(operator: Operator) -> None:
    before = operator.keyring.read_bytes()
    operator.cryptd("master-key", "generate", "--out", str(operator.root / "other.key"))
    result = _run(
        ROTATE,
        "payments",
        "--master-key",
        str(operator.root / "other.key"),
        "--keyring",
        str(operator.keyring),
        env=operator.env,
    )
    assert result.returncode == 1
    assert "cryptd keys rotate payments failed" in result.stderr
    assert operator.keyring.read_bytes() == before
    assert not operator.applied.exists()


def test_rotate_an_unknown_key_changes_nothing(operator: Operator) -> None:
    result = _run(
        ROTATE,
        "no-such-key",
        "--master-key",
        str(operator.master),
        "--keyring",
        str(operator.keyring),
        env=operator.env,
    )
    assert result.returncode == 1
    assert not operator.applied.exists()


def test_rotate_leaves_no_keyring_copy_behind(operator: Operator) -> None:
    tmp = operator.root / "tmp"
    tmp.mkdir()
    env = {**operator.env, "TMPDIR": str(tmp)}
    result = _run(
        ROTATE,
        "payments",
        "--master-key",
        str(operator.master),
        "--keyring",
        str(operator.keyring),
        "--dry-run",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert list(tmp.iterdir()) == []
