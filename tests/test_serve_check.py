"""A production configuration's problems all at once, in plain words saying what to set:
from ``Settings`` (missing and conflicting settings) and from ``cryptd serve`` and
``cryptd serve --check`` (files that do not load, a key store or Redis out of reach)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.config import Settings, settings_problems


@pytest.fixture
def problems(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """The problems ``Settings()`` reports for exactly the ``CRYPTD_*`` variables given (by
    field name), read from the environment as the server reads them."""
    for name in list(os.environ):
        if name.startswith("CRYPTD_"):
            monkeypatch.delenv(name)

    def read(**env: str) -> list[str]:
        for name, value in env.items():
            monkeypatch.setenv(f"CRYPTD_{name.upper()}", value)
        with pytest.raises(pydantic.ValidationError) as caught:
            Settings()
        return settings_problems(caught.value)

    return read


def test_three_missing_settings_are_named_at_once_in_plain_words(
    problems: Callable[..., list[str]],
) -> None:
    found = problems()
    assert len(found) == 3, found
    master, clients, tls = found
    assert master.startswith("no master key: set CRYPTD_MASTER_KEY_FILE")
    assert "cryptd master-key generate" in master
    assert clients.startswith("no API clients: set CRYPTD_CLIENTS_FILE")
    assert tls.startswith("TLS is required: set CRYPTD_TLS_CERT_FILE and CRYPTD_TLS_KEY_FILE")
    assert not [p for p in found if "Value error" in p or "validation error" in p]


def test_conflicts_and_weak_settings_are_reported_together(
    problems: Callable[..., list[str]],
) -> None:
    found = problems(
        master_key="x",
        clients_file="clients.json",
        keystore_url="postgresql://cryptd:pw@db.example:5432/keys",
        replay_fail_open="true",
        tls="off",
        tls_cert_file="server.crt",
        workers="2",
    )
    assert len(found) == 4, found
    assert found[0].startswith("CRYPTD_WORKERS=2 needs a replay store every worker shares")
    assert found[1].startswith("CRYPTD_KEYSTORE_URL reaches db.example without TLS")
    assert found[2].startswith("CRYPTD_REPLAY_FAIL_OPEN only applies with CRYPTD_REDIS_URL")
    assert found[3] == "CRYPTD_TLS=off, yet CRYPTD_TLS_*_FILE are set: choose one"
    assert not [p for p in found if "pw@" in p]


def test_a_field_error_names_its_variable_and_never_quotes_the_value(
    problems: Callable[..., list[str]],
) -> None:
    found = problems(env="development", port="99999", executors='{"rsa-2048": "nowhere"}')
    assert found[0] == "CRYPTD_PORT: Input should be less than or equal to 65535"
    assert found[1].startswith("CRYPTD_EXECUTORS[rsa-2048]: Input should be 'inline'")
    assert len(found) == 2, found
    assert not [p for p in found if "99999" in p or "nowhere" in p]


def test_an_invalid_value_and_a_missing_setting_are_reported_together(
    problems: Callable[..., list[str]],
) -> None:
    assert problems(port="0", clients_file="clients.json", tls="off") == [
        "CRYPTD_PORT: Input should be greater than or equal to 1",
        "no master key: set CRYPTD_MASTER_KEY_FILE to a file holding one (make it with "
        "`cryptd master-key generate --out master.key`), or CRYPTD_MASTER_KEY",
    ]


def test_a_url_error_is_said_once_without_the_url(problems: Callable[..., list[str]]) -> None:
    secret = "postgres-secret-value"
    found = problems(env="development", keystore_url=f"mysql://u:{secret}@h/db")
    assert found == ["CRYPTD_KEYSTORE_URL must be a postgresql:// URL"]


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
    assert "cryptd: error: the keyring is written under master key" in wrong_key.stderr
