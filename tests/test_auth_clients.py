"""Clients file: validation, policy, hot reload, atomic edits through `cryptd clients`."""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.auth.certs import identities_of
from service.auth.clients import (
    ClientRegistry,
    ClientsFile,
    ClientsFileError,
    load_registry,
    parse_allow_spec,
    parse_certificate_identity,
    show_certificate_identity,
)
from service.cli import main
from service.edge.devcerts import make_ca

GOOD = base64.b64encode(bytes(range(100, 132))).decode()  # 32 distinct, non-text bytes


def _write(path: Path, clients: dict[str, Any]) -> None:
    path.write_text(json.dumps({"clients": clients}))


def _load(tmp_path: Path, clients: dict[str, Any]) -> ClientRegistry:
    path = tmp_path / "clients.json"
    _write(path, clients)
    return load_registry(path)


def test_load_and_policy(tmp_path: Path) -> None:
    registry = _load(
        tmp_path,
        {
            "billing": {
                "secret": GOOD,
                "allow": [
                    {"keys": "billing-*", "operations": ["encrypt", "decrypt"]},
                    {"keys": "shared", "operations": ["*"]},
                ],
            },
            "ops.admin_1": {"secret": GOOD, "admin": True},
        },
    )
    billing = registry.get("billing")
    assert billing is not None
    assert not billing.admin
    assert billing.secret == bytes(range(100, 132))
    assert billing.allows("billing-2024", "encrypt")
    assert billing.allows("billing-2024", "decrypt")
    assert not billing.allows("billing-2024", "sign")
    assert not billing.allows("Billing-2024", "encrypt")  # case-sensitive globs
    assert not billing.allows("orders", "encrypt")
    assert billing.allows("shared", "rewrap")
    assert not billing.allows("shared2", "rewrap")  # the glob is anchored
    admin = registry.get("ops.admin_1")
    assert admin is not None
    assert admin.admin
    assert not admin.allows("billing-1", "encrypt")  # admin manages keys, uses none
    assert registry.get("nobody") is None
    assert registry.secret_for("nobody") is None
    assert len(registry) == 2


def test_client_never_shows_or_pickles_its_secret(tmp_path: Path) -> None:
    client = _load(tmp_path, {"c": {"secret": GOOD}}).get("c")
    assert client is not None
    assert GOOD not in repr(client)
    assert repr(client.secret) not in repr(client)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(client)


@pytest.mark.parametrize(
    ("clients", "message"),
    [
        ({"bad id!": {"secret": GOOD}}, "must match"),
        ({"x" * 65: {"secret": GOOD}}, "must match"),
        ({"c": {}}, "'secret' is missing"),
        ({"c": {"secret": "not base64!"}}, "not valid base64"),
        ({"c": {"secret": base64.b64encode(os.urandom(31)).decode()}}, "31 bytes"),
        ({"c": {"secret": base64.b64encode(b"\x01" * 32).decode()}}, "too little entropy"),
        (
            {"c": {"secret": base64.b64encode(b"correct horse battery staple 1234").decode()}},
            "too little entropy",
        ),
        ({"c": {"secret": GOOD, "admin": "yes"}}, "'admin' must be true or false"),
        ({"c": {"secret": GOOD, "allow": [{"keys": "*", "operations": ["launch"]}]}}, "launch"),
        ({"c": {"secret": GOOD, "allow": [{"keys": "*"}]}}, "each 'allow' entry"),
        ({"c": {"secret": GOOD, "allow": [{"keys": "", "operations": ["*"]}]}}, "non-empty"),
        ({"c": {"secret": GOOD, "role": "x"}}, "unknown field"),
    ],
)
def test_invalid_clients_are_refused_by_name(
    tmp_path: Path, clients: dict[str, Any], message: str
) -> None:
    with pytest.raises(ClientsFileError, match=message) as info:
        _load(tmp_path, clients)
    secret = next(iter(clients.values())).get("secret")
    if isinstance(secret, str):
        assert secret not in str(info.value)  # name the client, never the secret


def test_bad_documents(tmp_path: Path) -> None:
    path = tmp_path / "clients.json"
    path.write_text('{"clients": {"a": {"secret": "' + GOOD + '"}, "a": {"secret": "x"}}}')
    with pytest.raises(ClientsFileError, match="duplicate key 'a'"):
        load_registry(path)
    path.write_text('{"clients": {"a": {"secret": "' + GOOD + '"')
    with pytest.raises(ClientsFileError, match="not valid JSON") as info:
        load_registry(path)
    assert GOOD not in str(info.value)
    path.write_text("[]")
    with pytest.raises(ClientsFileError, match="JSON object"):
        load_registry(path)
    with pytest.raises(ClientsFileError, match="does not exist"):
        load_registry(tmp_path / "missing.json")


def test_allow_spec() -> None:
    assert parse_allow_spec("billing-*:encrypt,decrypt") == {
        "keys": "billing-*",
        "operations": ["encrypt", "decrypt"],
    }
    with pytest.raises(ClientsFileError):
        parse_allow_spec("no-operations")
    with pytest.raises(ClientsFileError, match="fly"):
        parse_allow_spec("*:fly")


def test_reload_on_change_and_keep_previous_on_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "clients.json"
    _write(path, {"a": {"secret": GOOD}})
    source = ClientsFile(path, interval=0)
    assert source().get("a") is not None
    assert not source.reload_if_changed()  # unchanged file: nothing to do

    _write(path, {"a": {"secret": GOOD}, "b": {"secret": GOOD}})
    assert source().get("b") is not None

    caplog.set_level(logging.ERROR, logger="cryptd.auth")
    short = base64.b64encode(os.urandom(16)).decode()
    _write(path, {"c": {"secret": short}})
    registry = source()
    assert registry.get("b") is not None
    assert registry.get("c") is None
    assert any("'c'" in r.getMessage() and "16 bytes" in r.getMessage() for r in caplog.records)
    assert all(short not in r.getMessage() for r in caplog.records)
    logged = len(caplog.records)
    source()
    assert len(caplog.records) == logged  # a bad version is reported once, not every poll

    path.unlink()
    assert source().get("b") is not None  # a vanished file keeps the clients too


def test_reload_follows_a_kubernetes_style_symlink_swap(tmp_path: Path) -> None:
    # A Secret volume: clients.json -> ..data/clients.json, ..data -> ..2024_1 (swapped).
    for version, client in (("..v1", "first"), ("..v2", "second")):
        (tmp_path / version).mkdir()
        _write(tmp_path / version / "clients.json", {client: {"secret": GOOD}})
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "clients.json").symlink_to("..data/clients.json")
    source = ClientsFile(tmp_path / "clients.json", interval=0)
    assert source().get("first") is not None

    (tmp_path / "..data_tmp").symlink_to("..v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    registry = source()
    assert registry.get("second") is not None
    assert registry.get("first") is None


# --------------------------------------------------------------------------------------------
# `cryptd clients`


def test_cli_add_list_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "clients.json"
    args = [
        "clients",
        "add",
        "billing",
        "--allow",
        "billing-*:encrypt,decrypt",
        "--file",
        str(path),
    ]
    assert main(args) == 0
    out = capsys.readouterr()
    secret = out.out.strip()
    assert len(base64.b64decode(secret, validate=True)) == 32
    assert "only once" in out.err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    client = load_registry(path).get("billing")
    assert client is not None
    assert client.secret == base64.b64decode(secret)
    assert client.allows("billing-x", "decrypt")
    assert not client.allows("billing-x", "sign")

    assert main(["clients", "add", "ops", "--admin", "--file", str(path)]) == 0
    assert main(["clients", "add", "ops", "--file", str(path)]) == 1  # exists already
    capsys.readouterr()

    assert main(["clients", "list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    assert secret not in listing
    assert "secret" not in listing
    assert json.loads(listing) == {
        "clients": [
            {
                "client_id": "billing",
                "admin": False,
                "allow": [{"keys": "billing-*", "operations": ["decrypt", "encrypt"]}],
            },
            {"client_id": "ops", "admin": True, "allow": []},
        ]
    }

    assert main(["clients", "remove", "billing", "--file", str(path)]) == 0
    assert main(["clients", "remove", "billing", "--file", str(path)]) == 1
    assert load_registry(path).get("billing") is None
    assert [p.name for p in tmp_path.iterdir()] == ["clients.json"]  # no temp files left


def test_cli_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "clients.json"
    monkeypatch.setenv("CRYPTD_CLIENTS_FILE", str(path))
    assert main(["clients", "add", "bad id"]) == 2
    assert main(["clients", "add", "ok", "--allow", "*:fly"]) == 2
    assert "fly" in capsys.readouterr().err
    assert not path.exists()
    path.write_text("{broken")
    assert main(["clients", "add", "ok"]) == 2  # never rewrite a file that does not load
    assert path.read_text() == "{broken"
    monkeypatch.delenv("CRYPTD_CLIENTS_FILE")
    assert main(["clients", "list"]) == 2
    assert "CRYPTD_CLIENTS_FILE" in capsys.readouterr().err


@pytest.mark.slow
def test_concurrent_adds_keep_every_client(tmp_path: Path) -> None:
    path = tmp_path / "clients.json"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "service.cli", "clients", "add", f"c{i}", "--file", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=Path(__file__).parent.parent,
        )
        for i in range(6)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0] * 6
    assert sorted(c.client_id for c in load_registry(path)) == [f"c{i}" for i in range(6)]


def _certificate(*names: x509.GeneralName) -> str:
    ca = make_ca("identity test CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "certonly.example")]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def test_certificate_identities_match_only_their_own_type(tmp_path: Path) -> None:
    """A URI SAN spelled like a host name is not that DNS name, nor the other way round."""
    registry = _load(
        tmp_path,
        {
            "by-dns": {"authentication": "certificate", "certificates": ["certonly.example"]},
            "by-uri": {
                "authentication": "certificate",
                "certificates": ["URI:spiffe://test.example/app"],
            },
            "typed-dns": {"authentication": "certificate", "certificates": ["DNS:typed.example"]},
        },
    )

    def client_of(*names: x509.GeneralName) -> str | None:
        found = registry.by_certificate(identities_of(_certificate(*names)))
        return None if found is None else found.client_id

    assert client_of(x509.UniformResourceIdentifier("certonly.example")) is None
    assert client_of(x509.DNSName("certonly.example")) == "by-dns"
    assert client_of(x509.UniformResourceIdentifier("spiffe://test.example/app")) == "by-uri"
    assert client_of(x509.DNSName("spiffe://test.example/app")) is None
    assert client_of(x509.DNSName("typed.example")) == "typed-dns"
    assert client_of(x509.UniformResourceIdentifier("typed.example")) is None


@pytest.mark.parametrize(
    ("listed", "typed"),
    [
        ("batch.example.org", "DNS:batch.example.org"),
        ("spiffe://example.org/ns/a/sa/b", "URI:spiffe://example.org/ns/a/sa/b"),
        ("DNS:batch.example.org", "DNS:batch.example.org"),
        ("dns:*.example.org", "DNS:*.example.org"),
        ("URI:spiffe://example.org/x", "URI:spiffe://example.org/x"),
        ("dns://resolver.example/x", "URI:dns://resolver.example/x"),
    ],
)
def test_certificate_identity_spellings(listed: str, typed: str) -> None:
    assert parse_certificate_identity("c", listed) == typed
    shown = show_certificate_identity(typed)  # as `cryptd clients list` shows it
    assert parse_certificate_identity("c", shown) == typed
    assert ":" not in shown.partition("://")[0]  # untyped: every one of these reads back


@pytest.mark.parametrize(
    "listed", ["URI:certonly.example", "DNS:spiffe://x.example/a", "IP:127.0.0.1", "DNS:", ""]
)
def test_certificate_identity_with_the_wrong_form_for_its_type_is_refused(listed: str) -> None:
    with pytest.raises(ClientsFileError, match="certificate identity"):
        parse_certificate_identity("c", listed)
