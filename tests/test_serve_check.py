"""A production configuration's problems all at once, in plain words saying what to set:
from ``Settings`` (missing and conflicting settings) and from ``cryptd serve`` and
``cryptd serve --check`` (files that do not load, a key store or Redis out of reach)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.config import Settings, settings_problems


@pytest.fixture
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CRYPTD_"):
            monkeypatch.delenv(name)


def _problems(**env: object) -> list[str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(**env)  # type: ignore[arg-type]
    return settings_problems(caught.value)


@pytest.mark.usefixtures("no_settings")
def test_three_missing_settings_are_named_at_once_in_plain_words() -> None:
    problems = _problems()
    assert len(problems) == 3, problems
    master, clients, tls = problems
    assert master.startswith("no master key: set CRYPTD_MASTER_KEY_FILE")
    assert "cryptd master-key generate" in master
    assert clients.startswith("no API clients: set CRYPTD_CLIENTS_FILE")
    assert tls.startswith("TLS is required: set CRYPTD_TLS_CERT_FILE and CRYPTD_TLS_KEY_FILE")
    assert not [p for p in problems if "Value error" in p or "validation error" in p]


@pytest.mark.usefixtures("no_settings")
def test_conflicts_and_weak_settings_are_reported_together() -> None:
    problems = _problems(
        master_key="x",
        clients_file="clients.json",
        keystore_url="postgresql://cryptd:pw@db.example:5432/keys",
        replay_fail_open="true",
        tls="off",
        tls_cert_file="server.crt",
        workers="2",
    )
    assert len(problems) == 4, problems
    assert problems[0].startswith("CRYPTD_WORKERS=2 needs a replay store every worker shares")
    assert problems[1].startswith("CRYPTD_KEYSTORE_URL reaches db.example without TLS")
    assert problems[2].startswith("CRYPTD_REPLAY_FAIL_OPEN only applies with CRYPTD_REDIS_URL")
    assert problems[3] == "CRYPTD_TLS=off, yet CRYPTD_TLS_*_FILE are set: choose one"
    assert not [p for p in problems if "pw@" in p]


@pytest.mark.usefixtures("no_settings")
def test_a_field_error_names_its_variable_and_never_quotes_the_value() -> None:
    problems = _problems(env="development", port="99999", executors={"rsa-2048": "nowhere"})
    assert problems[0] == "CRYPTD_PORT: Input should be less than or equal to 65535"
    assert problems[1].startswith("CRYPTD_EXECUTORS[rsa-2048]: Input should be 'inline'")
    assert not [p for p in problems if "99999" in p or "nowhere" in p]
    secret = "postgres-secret-value"
    (url_problem,) = _problems(env="development", keystore_url=f"mysql://u:{secret}@h/db")
    assert url_problem == "CRYPTD_KEYSTORE_URL must be a postgresql:// URL"


def _cryptd(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_a_production_start_missing_three_settings_names_all_three(tmp_path: Path) -> None:
    done = _cryptd(["serve", "--port", "1"], {}, tmp_path)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0] == "cryptd: the configuration has 3 problems:"
    assert [line.split(":")[2].strip() for line in lines[1:]] == [
        "no master key",
        "no API clients",
        "TLS is required",
    ]
    assert "Value error" not in done.stderr
    assert "Traceback" not in done.stderr


def _expired_certificate(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired.example")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "expired.crt", directory / "expired.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.mark.slow
def test_check_reports_every_file_and_store_problem_and_serves_nothing(tmp_path: Path) -> None:
    assert _cryptd(["master-key", "generate", "--out", "master.key"], {}, tmp_path).returncode == 0
    (tmp_path / "clients.json").write_text("{not json")
    (tmp_path / "server.crt").write_text("not a certificate\n")
    (tmp_path / "server.key").write_text("not a key\n")
    env = {
        "CRYPTD_MASTER_KEY_FILE": str(tmp_path / "master.key"),
        "CRYPTD_CLIENTS_FILE": str(tmp_path / "clients.json"),
        "CRYPTD_KEYRING_FILE": str(tmp_path / "keyring.json"),  # never created
        "CRYPTD_TLS_CERT_FILE": str(tmp_path / "server.crt"),
        "CRYPTD_TLS_KEY_FILE": str(tmp_path / "server.key"),
        "CRYPTD_REDIS_URL": "redis://:redis-password@127.0.0.1:1/0",  # nothing listens on 1
        "CRYPTD_AUDIT_LOG": str(tmp_path / "missing-directory" / "audit.log"),
    }
    done = _cryptd(["serve", "--check"], env, tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "cryptd: the configuration has 5 problems:"
    problems = [line.removeprefix("cryptd: error: ") for line in lines[1:]]
    assert (
        problems[0] == f"CRYPTD_TLS_CERT_FILE {tmp_path / 'server.crt'}: no PEM certificate in it"
    )
    assert problems[1].startswith(f"CRYPTD_CLIENTS_FILE {tmp_path / 'clients.json'}")
    assert problems[2].startswith(f"no keyring in file {tmp_path / 'keyring.json'}")
    assert "cryptd keystore init" in problems[2]
    assert problems[3] == "CRYPTD_REDIS_URL redis://127.0.0.1:1/0: not reachable (ConnectionError)"
    assert problems[4].startswith(f"CRYPTD_AUDIT_LOG {tmp_path / 'missing-directory'}")
    assert "redis-password" not in done.stderr
    assert not (tmp_path / "keyring.json").exists()

    cert_file, key_file = _expired_certificate(tmp_path)
    assert _cryptd(["keystore", "init"], env, tmp_path).returncode == 0
    (tmp_path / "clients.json").write_text('{"clients": {}}')
    env |= {"CRYPTD_TLS_CERT_FILE": str(cert_file), "CRYPTD_TLS_KEY_FILE": str(key_file)}
    del env["CRYPTD_REDIS_URL"], env["CRYPTD_AUDIT_LOG"]
    expired = _cryptd(["serve", "--check"], env, tmp_path)
    assert expired.returncode == 2, expired.stderr
    assert "the certificate expired on" in expired.stderr
    assert "install a renewed one" in expired.stderr
    env["CRYPTD_MASTER_KEY_FILE"] = str(tmp_path / "other.key")
    assert _cryptd(["master-key", "generate", "--out", "other.key"], {}, tmp_path).returncode == 0
    wrong_key = _cryptd(["serve", "--check"], env, tmp_path)
    assert wrong_key.returncode == 2
    assert "cryptd: error: the keyring was written under master key" in wrong_key.stderr
