"""Seals (service/seal/): the static seal and the PKCS#11 seal against a real SoftHSM2 token."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path

import orjson
import pkcs11
import pytest
from pkcs11 import Attribute, KeyType, ObjectClass
from pydantic import ValidationError

from service.api.application import create_app
from service.cli import main
from service.config import SealSettings, Settings
from service.keys.masterkey import MasterKey
from service.logs import configure_logging
from service.seal import SealError, open_seal
from service.seal import pkcs11 as pkcs11_seal
from service.seal.pkcs11 import Pkcs11Seal
from service.seal.static import StaticSeal
from tests.test_seal_support import PIN, SOFTHSM_MODULE, Token, make_store, make_token


@pytest.fixture
def token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Token:
    made = make_token(tmp_path / "hsm")
    _use(made, monkeypatch)
    return made


def _use(token: Token, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this process's SoftHSM2 at ``token``'s configuration (reread on initialise)."""
    monkeypatch.setenv("SOFTHSM2_CONF", str(token.conf))
    pkcs11_seal.reinitialize(SOFTHSM_MODULE)


def _seal(token: Token, sealed: Path, *, key_label: str = "cryptd-seal") -> Pkcs11Seal:
    return Pkcs11Seal(SOFTHSM_MODULE, token.label, key_label, token.pin_file, sealed)


@pytest.fixture
def sealed_file(tmp_path: Path) -> Path:
    return tmp_path / "sealed-master-key.json"


@pytest.fixture
def seal(token: Token, sealed_file: Path) -> Iterator[Pkcs11Seal]:
    made = _seal(token, sealed_file)
    yield made
    made.close()


# -- static ---------------------------------------------------------------------------------


def test_static_seal_gives_the_configured_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = secrets.token_bytes(32)
    monkeypatch.setenv("CRYPTD_MASTER_KEY", base64.b64encode(key).decode())
    seal = open_seal(SealSettings())
    assert isinstance(seal, StaticSeal)
    assert seal.unseal() == key
    assert seal.status().sealed is False
    assert seal.status().available is True


@pytest.mark.parametrize(
    ("value", "message"),
    [(None, "needs CRYPTD_MASTER_KEY"), ("not base64!", "not valid base64")],
)
def test_static_seal_refuses_a_missing_or_bad_key(
    monkeypatch: pytest.MonkeyPatch, value: str | None, message: str
) -> None:
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    monkeypatch.delenv("CRYPTD_MASTER_KEY_FILE", raising=False)
    if value is not None:
        monkeypatch.setenv("CRYPTD_MASTER_KEY", value)
    with pytest.raises(SealError, match=message) as caught:
        StaticSeal(SealSettings()).unseal()
    assert caught.value.code == "sealed"


# -- settings -------------------------------------------------------------------------------


def test_pkcs11_refuses_a_master_key_in_the_environment(
    token: Token, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in token.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CRYPTD_MASTER_KEY", base64.b64encode(secrets.token_bytes(32)).decode())
    with pytest.raises(ValidationError, match="unset CRYPTD_MASTER_KEY"):
        SealSettings()


def test_pkcs11_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYPTD_SEAL", "pkcs11")
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    monkeypatch.delenv("CRYPTD_MASTER_KEY_FILE", raising=False)
    monkeypatch.setenv("CRYPTD_PKCS11_MODULE", str(SOFTHSM_MODULE))
    with pytest.raises(ValidationError, match="CRYPTD_PKCS11_TOKEN_LABEL, CRYPTD_PKCS11_PIN_FILE"):
        SealSettings()


def test_unknown_seal_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYPTD_SEAL", "plaintext")
    with pytest.raises(ValidationError):
        SealSettings()


def test_sealed_file_defaults_beside_the_keyring(tmp_path: Path) -> None:
    settings = SealSettings(keyring_file=tmp_path / "k" / "keyring.json")
    assert settings.sealed_master_key_path() == tmp_path / "k" / "sealed-master-key.json"


# -- pkcs11 ---------------------------------------------------------------------------------


def test_init_seals_the_master_key_under_a_non_extractable_token_key(
    seal: Pkcs11Seal, token: Token, sealed_file: Path
) -> None:
    master = secrets.token_bytes(32)
    report = seal.init(master)
    assert report.token_key_created
    assert report.key_id == MasterKey(master).key_id
    assert seal.unseal() == master
    # Only ciphertext at rest: neither the raw key nor its base64 is in the file.
    stored = sealed_file.read_bytes()
    assert master not in stored
    assert base64.b64encode(master) not in stored
    assert orjson.loads(stored)["format"] == "cryptd-sealed-master-key/1"
    seal.close()
    lib = pkcs11_seal.library(SOFTHSM_MODULE)
    with lib.get_token(token_label=token.label).open(user_pin=PIN) as session:
        key = session.get_key(
            object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label="cryptd-seal"
        )
        assert key[Attribute.VALUE_LEN] == 32
        assert key[Attribute.EXTRACTABLE] is False
        assert key[Attribute.SENSITIVE] is True
        with pytest.raises(pkcs11.exceptions.AttributeSensitive):
            key[Attribute.VALUE]


def test_init_reuses_the_token_key_and_never_replaces_a_sealed_key(
    seal: Pkcs11Seal, token: Token, tmp_path: Path
) -> None:
    seal.init()
    first = seal.unseal()
    with pytest.raises(SealError, match="already exists"):
        seal.init()
    assert seal.unseal() == first
    other = _seal(token, tmp_path / "second.json")
    try:
        report = other.init()
        assert report.token_key_created is False
        assert other.unseal() != first  # a new master key under the same token key
    finally:
        other.close()


def test_a_fresh_master_key_each_init(token: Token, tmp_path: Path) -> None:
    keys = set()
    for index in range(3):
        seal = _seal(token, tmp_path / f"s{index}.json")
        try:
            seal.init()
            keys.add(seal.unseal())
        finally:
            seal.close()
    assert len(keys) == 3
    assert all(len(key) == 32 for key in keys)


def test_wrong_pin_unseals_nothing(seal: Pkcs11Seal, token: Token, sealed_file: Path) -> None:
    seal.init()
    seal.close()
    token.pin_file.write_text("not-the-pin\n")
    with pytest.raises(SealError, match="PIN in CRYPTD_PKCS11_PIN_FILE is wrong"):
        _seal(token, sealed_file).unseal()


def test_missing_token_and_missing_module(token: Token, sealed_file: Path) -> None:
    seal = _seal(token, sealed_file)
    seal.init()
    seal.close()
    absent = Pkcs11Seal(SOFTHSM_MODULE, "no-such-token", "cryptd-seal", token.pin_file, sealed_file)
    with pytest.raises(SealError, match="no PKCS#11 token labelled 'no-such-token'"):
        absent.unseal()
    absent.close()
    module = Pkcs11Seal(
        Path("/nonexistent/libpkcs11.so"), token.label, "cryptd-seal", token.pin_file, sealed_file
    )
    with pytest.raises(SealError, match="cannot be loaded"):
        module.unseal()


def test_a_config_naming_a_missing_key_is_refused(
    seal: Pkcs11Seal, token: Token, tmp_path: Path, sealed_file: Path
) -> None:
    seal.init()
    seal.close()
    # The sealed file names its key: another label is refused before the token is asked.
    with pytest.raises(SealError, match="not pkcs11 key 'other-label'"):
        _seal(token, sealed_file, key_label="other-label").unseal()
    # A token that lacks the key (a new token with the same label): says so and what to do.
    fresh = make_token(tmp_path / "fresh", label=token.label)
    (tmp_path / "fresh" / "pin").write_text(PIN)
    token.remove()
    fresh.directory.rename(token.directory)
    pkcs11_seal.reinitialize(SOFTHSM_MODULE)  # as a new process would see the token
    with pytest.raises(SealError, match=r"holds no AES key labelled 'cryptd-seal'.*operator init"):
        _seal(token, sealed_file).unseal()


def test_no_sealed_file_says_to_run_init(seal: Pkcs11Seal) -> None:
    with pytest.raises(SealError, match="run `cryptd operator init`"):
        seal.unseal()


@pytest.mark.parametrize("field", ["ciphertext", "nonce", "key_label_in_aad", "key_id"])
def test_a_tampered_sealed_file_is_refused(
    seal: Pkcs11Seal, token: Token, sealed_file: Path, field: str
) -> None:
    seal.init()
    seal.close()
    document = orjson.loads(sealed_file.read_bytes())
    if field in ("ciphertext", "nonce"):
        raw = bytearray(base64.b64decode(document[field]))
        raw[0] ^= 1
        document[field] = base64.b64encode(bytes(raw)).decode()
        expected = "does not open"
    elif field == "key_id":
        document["key_id"] = "0" * 16
        expected = "is not a master key"
    else:
        # A file relabelled to pass the label check names another token key: refused.
        document["key_label"] = "relabelled"
        expected = "does not open"
    sealed_file.write_bytes(orjson.dumps(document))
    key_label = "relabelled" if field == "key_label_in_aad" else "cryptd-seal"
    if field == "key_label_in_aad":
        other = _seal(token, sealed_file.with_name("x.json"), key_label="relabelled")
        other.init()
        other.close()
    with pytest.raises(SealError, match=expected):
        _seal(token, sealed_file, key_label=key_label).unseal()


def test_a_sealed_file_from_another_token_is_refused(
    seal: Pkcs11Seal,
    token: Token,
    sealed_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seal.init()
    seal.close()
    foreign_token = make_token(tmp_path / "foreign", label=token.label)
    _use(foreign_token, monkeypatch)
    foreign = _seal(foreign_token, tmp_path / "foreign.json")
    foreign.init()
    foreign.close()
    _use(token, monkeypatch)
    sealed_file.write_bytes((tmp_path / "foreign.json").read_bytes())
    with pytest.raises(SealError, match="does not open under token key"):
        _seal(token, sealed_file).unseal()


def test_status_follows_the_token(
    seal: Pkcs11Seal, token: Token, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pkcs11_seal, "STATUS_CACHE_SECONDS", 0.0)
    seal.init()
    master = seal.unseal()
    assert seal.status().available is True
    away = token.remove()
    status = seal.status()
    assert status.available is False
    assert status.sealed is False
    assert status.reason is not None
    assert "token unavailable" in status.reason
    token.restore(away)
    assert seal.status().available is True
    assert seal.unseal() == master


def test_status_is_cached(seal: Pkcs11Seal, token: Token) -> None:
    seal.init()
    assert seal.status().available is True
    away = token.remove()
    try:
        assert seal.status().available is True  # within STATUS_CACHE_SECONDS: not asked again
    finally:
        token.restore(away)


# -- the CLI --------------------------------------------------------------------------------


def test_operator_init_then_keystore_init_and_keys(
    token: Token,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    monkeypatch.delenv("CRYPTD_MASTER_KEY_FILE", raising=False)
    monkeypatch.delenv("CRYPTD_KEYSTORE_URL", raising=False)
    for name, value in token.env().items():
        monkeypatch.setenv(name, value)
    keyring = tmp_path / "store" / "keyring.json"
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(keyring))
    assert main(["operator", "init"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report["token_key_created"] is True
    assert report["sealed_master_key_file"] == str(keyring.with_name("sealed-master-key.json"))
    assert main(["operator", "init"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["keystore", "init"]) == 0
    capsys.readouterr()
    assert main(["keys", "create", "--type", "aes256-gcm", "payments"]) == 0
    capsys.readouterr()
    assert main(["keystore", "show"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert shown["keys"] == 1
    assert shown["versions"] == 1
    token.pin_file.write_text("93857261\n")
    assert main(["keystore", "show"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "PIN in CRYPTD_PKCS11_PIN_FILE is wrong" in err
    assert "93857261" not in err


def test_operator_init_seals_an_existing_static_key(
    token: Token,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Moving a static deployment to the token: the same master key, sealed; the key store
    opens unchanged under the pkcs11 seal."""
    master = secrets.token_bytes(32)
    key_file = tmp_path / "master.key"
    key_file.write_text(base64.b64encode(master).decode())
    keyring = tmp_path / "keyring.json"
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    monkeypatch.setenv("CRYPTD_MASTER_KEY_FILE", str(key_file))
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(keyring))
    assert main(["keystore", "init"]) == 0
    assert main(["keys", "create", "--type", "aes256-gcm", "k"]) == 0
    monkeypatch.delenv("CRYPTD_MASTER_KEY_FILE")
    for name, value in token.env().items():
        monkeypatch.setenv(name, value)
    assert main(["operator", "init", "--master-key-file", str(key_file)]) == 0
    key_file.unlink()
    capsys.readouterr()
    assert main(["keystore", "show"]) == 0
    assert orjson.loads(capsys.readouterr().out)["keys"] == 1


def test_operator_init_static_writes_the_key_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "master.key"
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    monkeypatch.delenv("CRYPTD_SEAL", raising=False)
    monkeypatch.setenv("CRYPTD_MASTER_KEY_FILE", str(key_file))
    assert main(["operator", "init"]) == 0
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert len(base64.b64decode(key_file.read_text())) == 32
    assert main(["operator", "init"]) == 1
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "worker", "warned"),
    [("production", 0, True), ("development", 0, False), ("production", 1, False)],
)
def test_static_seal_warns_at_every_production_start(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], env: str, worker: int, warned: bool
) -> None:
    """Once per start: by the first server worker (each start of it), not by every worker."""
    master = secrets.token_bytes(32)
    make_store(tmp_path, master)
    encoded = base64.b64encode(master).decode()
    create_app(
        Settings(
            env=env,  # type: ignore[arg-type]
            tls="off",
            master_key=encoded,  # type: ignore[arg-type]
            keyring_file=tmp_path / "keyring.json",
            clients_file=tmp_path / "clients.json",
            audit_log="off",
            worker_index=worker,
            workers=2,
            replay_dir=tmp_path / "replay",
        )
    )
    configure_logging("info", False, "off")  # replaces the app's setup: its writer drains
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "CRYPTD_SEAL=static" in line]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert orjson.loads(lines[0])["level"] == "warning"
    assert encoded not in err
