"""The PostgreSQL overlay (k8s/postgresql): replicas share a PostgreSQL key store. Checked
like the other manifests (schemas, lint, the security review of tests/test_k8s.py, run on the
real kustomize output), plus what this deployment changes: no keyring Secret, the key store
URL from a Secret, the database's CA mounted for TLS, egress to the database, a writable
key store, and a configuration the server accepts."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests import test_k8s as k8s
from tests.test_k8s_support import K8S, ROOT, parse_docs, tool

OVERLAY = K8S / "postgresql"
Doc = dict[str, Any]
URL = "postgresql://cryptd:pw@db.internal:5432/cryptd?sslmode=verify-full&sslrootcert=/etc/cryptd/keystore-ca/ca.crt"

# The review of tests/test_k8s.py that holds for every deployment, run on this one.
SHARED_CHECKS: list[Callable[[list[Doc]], None]] = [
    k8s.test_deployments_select_their_own_pods,
    k8s.test_services_select_the_pods_and_name_their_ports,
    k8s.test_hpa_and_pdb_target_the_server,
    k8s.test_service_monitor_scrapes_the_service,
    k8s.test_volumes_and_mounts_line_up,
    k8s.test_every_config_map_referenced_is_produced,
    k8s.test_server_ingress_only_from_client_namespaces_and_prometheus,
    k8s.test_redis_admits_only_cryptd_and_calls_nobody,
    k8s.test_overlay_denies_everything_else_in_the_namespace,
    k8s.test_pods_run_as_non_root_with_runtime_default_seccomp,
    k8s.test_containers_are_locked_down,
    k8s.test_no_service_account_token_and_no_service_links,
    k8s.test_resources_have_requests_and_limits,
    k8s.test_server_probes,
    k8s.test_termination_lets_in_flight_requests_drain,
    k8s.test_secrets_are_mounted_read_only_whole_never_by_sub_path,
    k8s.test_writable_paths_are_bounded_empty_dirs,
    k8s.test_images_are_pinned,
    k8s.test_everything_is_labelled_and_namespaced,
    k8s.test_namespace_enforces_the_restricted_pod_security_standard,
]


@pytest.fixture(scope="module")
def rendered() -> list[Doc]:
    return k8s.render_with_kustomize(OVERLAY)


@pytest.mark.parametrize("check", SHARED_CHECKS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_shared_review(rendered: list[Doc], check: Callable[[list[Doc]], None]) -> None:
    check(rendered)


@pytest.mark.slow
@pytest.mark.parametrize("version", k8s.K8S_VERSIONS)
def test_output_matches_the_kubernetes_schema(rendered: list[Doc], version: str) -> None:
    for doc in rendered:
        k8s._validate(doc, version)


def test_yamllint_is_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-c", str(ROOT / ".yamllint"), str(OVERLAY)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


def test_no_keyring_secret_and_the_url_from_a_secret(rendered: list[Doc]) -> None:
    deployment = k8s.server(rendered)
    spec = k8s.pod_spec(deployment)
    secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert "cryptd-keyring" not in secrets
    assert {"cryptd-master-key", "cryptd-clients", "cryptd-keystore-ca"} <= secrets
    cryptd = k8s.container(deployment, "cryptd")
    assert not [m for m in cryptd["volumeMounts"] if m["name"] == "keyring"]
    env = {e["name"]: e for e in cryptd["env"]}
    assert env["CRYPTD_KEYSTORE_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "cryptd-keystore", "key": "url"}
    }
    assert "value" not in env["CRYPTD_KEYSTORE_URL"]  # never in the manifest
    ca = next(m for m in cryptd["volumeMounts"] if m["name"] == "keystore-ca")
    assert ca == {"name": "keystore-ca", "mountPath": "/etc/cryptd/keystore-ca", "readOnly": True}


@cache
def secrets_from_script() -> dict[str, set[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "master.key").write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
        (work / "clients.json").write_text('{"clients": {}}')
        (work / "keystore-url").write_text(URL + "\n")
        (work / "ca.crt").write_text(
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
        )
        # The server's own certificate (Secret cryptd-tls), as made without cert-manager.
        from service.edge.devcerts import issue, make_ca

        tls_ca = make_ca("make-secrets test CA")
        leaf = issue(tls_ca, ["cryptd.cryptd.svc"])
        (work / "tls.crt").write_bytes(leaf.cert_pem())
        (work / "tls.key").write_bytes(leaf.key_pem())
        (work / "tls-ca.crt").write_bytes(tls_ca.cert_pem())
        result = subprocess.run(
            [
                str(K8S / "scripts" / "make-secrets.sh"),
                "--master-key",
                str(work / "master.key"),
                "--keystore-url-file",
                str(work / "keystore-url"),
                "--keystore-ca",
                str(work / "ca.crt"),
                "--clients",
                str(work / "clients.json"),
                "--redis-password-file",
                str(work / "redis-password"),
                "--tls-cert",
                str(work / "tls.crt"),
                "--tls-key",
                str(work / "tls.key"),
                "--tls-ca",
                str(work / "tls-ca.crt"),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": f"{Path(tool('kubectl')).parent}:{os.environ['PATH']}"},
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    docs = [d for d in parse_docs(result.stdout) if d["kind"] == "Secret"]
    url = next(d for d in docs if d["metadata"]["name"] == "cryptd-keystore")["data"]["url"]
    assert base64.b64decode(url).decode() == URL  # as given, no trailing newline
    return {d["metadata"]["name"]: set(d["data"]) for d in docs}


def test_every_secret_referenced_is_built_by_the_script_and_documented(
    rendered: list[Doc],
) -> None:
    assert not [d for d in rendered if d["kind"] == "Secret"]
    built = secrets_from_script()
    assert "cryptd-keyring" not in built
    deploy_doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    for name, keys in k8s._secret_references(rendered).items():
        assert name in built, f"make-secrets.sh does not build {name}"
        assert keys <= built[name], (name, keys - built[name])
        assert f"`{name}`" in deploy_doc, f"docs/DEPLOY.md does not mention {name}"


@pytest.mark.parametrize(
    "arguments",
    [
        ["--keyring", "keyring.json", "--keystore-url-file", "url"],  # both stores
        ["--keystore-ca", "ca.crt", "--keyring", "keyring.json"],  # a CA without the URL
        ["--keystore-url-file", "url"],  # the URL without the CA
        [],  # neither
    ],
)
def test_make_secrets_refuses_a_muddled_key_store(tmp_path: Path, arguments: list[str]) -> None:
    for name in ("master.key", "clients.json", "keyring.json", "url", "ca.crt"):
        (tmp_path / name).write_text(base64.b64encode(os.urandom(32)).decode())
    (tmp_path / "url").write_text(URL)
    result = subprocess.run(
        [
            str(K8S / "scripts" / "make-secrets.sh"),
            "--master-key",
            "master.key",
            "--clients",
            "clients.json",
            "--redis-password-file",
            "redis-password",
            *arguments,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{Path(tool('kubectl')).parent}:{os.environ['PATH']}"},
        timeout=60,
    )
    assert result.returncode != 0
    assert "Secret" not in result.stdout


def test_the_server_may_reach_the_database_and_nothing_new_else(rendered: list[Doc]) -> None:
    spec = k8s._policy(rendered, "cryptd")["spec"]
    database = [rule for rule in spec["egress"] if any("ipBlock" in peer for peer in rule["to"])]
    assert database == [
        {
            "to": [{"ipBlock": {"cidr": "192.0.2.10/32"}}],
            "ports": [{"protocol": "TCP", "port": 5432}],
        }
    ]
    others = [rule for rule in spec["egress"] if rule not in database]
    assert len(others) == 2  # Redis and DNS, as in the base policy
    for rule in others:
        assert rule["to"], "an empty 'to' allows every destination"
        assert all("ipBlock" not in peer for peer in rule["to"])


def test_config_is_a_valid_production_configuration_with_a_writable_store(
    rendered: list[Doc], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.config import Settings

    data = k8s.config_map(rendered, "cryptd-config")["data"]
    fields = {f"CRYPTD_{name.upper()}" for name in Settings.model_fields}
    assert not {k for k in data if k.startswith("CRYPTD_")} - fields
    for name, value in data.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CRYPTD_REDIS_URL", "redis://cryptd:x@cryptd-redis:6379/0")
    monkeypatch.setenv("CRYPTD_KEYSTORE_URL", URL)
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    settings = Settings()
    assert settings.env == "production"
    assert settings.keyring_read_only is False
    assert settings.keystore_url_value() == URL
    # Propagation is notified; the activation delay covers the periodic backstop.
    assert settings.key_activation_delay > settings.keyring_reload_interval
