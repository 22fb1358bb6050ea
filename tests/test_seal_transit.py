"""The transit seal (service/seal/transit.py) against a real OpenBao Transit engine (``bao
server -dev``) and against another cryptd: init, unseal, rotation, and every refusal."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from service.cli import main
from service.config import SealSettings
from service.keys.masterkey import MasterKey
from service.seal import SealError, open_seal
from service.seal.rotation import SealedKeyFiles, files_for, files_from_spec, files_spec
from service.seal.transit import TransitSeal
from tests.conftest import Server, free_port
from tests.transit_support import Bao

pytestmark = pytest.mark.slow  # starts OpenBao


@pytest.fixture(scope="module")
def bao(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bao]:
    made = Bao(tmp_path_factory.mktemp("openbao"), tls=True).start()  # HTTPS, its own CA
    yield made
    made.stop()


@pytest.fixture
def key(bao: Bao) -> str:
    """A Transit key of this test's own."""
    name = "seal-" + secrets.token_hex(4)
    bao.create_key(name)
    return name


@pytest.fixture
def deployment(bao: Bao, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The environment of a transit deployment on ``key``; returns the keyring path."""
    for name in ("CRYPTD_MASTER_KEY", "CRYPTD_MASTER_KEY_FILE", "CRYPTD_KEYSTORE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in bao.env(key).items():
        monkeypatch.setenv(name, value)
    keyring = tmp_path / "keyring.json"
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(keyring))
    return keyring


def _init(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["operator", "init", *args]) == 0, capsys.readouterr().err
    report: dict[str, object] = orjson.loads(capsys.readouterr().out)
    return report


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert "Traceback" not in err
    return err


def test_init_wraps_the_master_key_and_the_store_opens_under_it(
    deployment: Path, key: str, bao: Bao, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _init(capsys)
    sealed = deployment.with_name("sealed-master-key.json")
    assert report["seal"] == "transit"
    assert report["transit_key"] == f"transit/{key}"
    assert report["transit_key_version"] == 1
    assert report["transit_address"] == bao.url
    assert report["sealed_master_key_file"] == str(sealed)
    seal = open_seal(SealSettings())
    try:
        master = seal.unseal()
    finally:
        seal.close()
    assert report["master_key_id"] == MasterKey(master).key_id
    document = orjson.loads(sealed.read_bytes())
    assert document["seal"] == "transit"
    assert base64.b64decode(document["ciphertext"]).startswith(b"vault:v1:")
    data = sealed.read_bytes()
    assert master not in data
    assert base64.b64encode(master) not in data
    # Never replaced: the key store may already be under it.
    assert "already exists" in _error(capsys, "operator", "init")
    assert main(["keystore", "init"]) == 0
    assert main(["keys", "create", "--type", "aes256-gcm", "payments"]) == 0
    capsys.readouterr()
    assert main(["keystore", "show"]) == 0
    assert orjson.loads(capsys.readouterr().out)["keys"] == 1


def _rewrite(path: Path, **fields: str) -> None:
    document = orjson.loads(path.read_bytes())
    document.update(fields)
    path.write_bytes(orjson.dumps(document))


def test_bad_input_unseals_nothing(
    deployment: Path,
    key: str,
    bao: Bao,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _init(capsys)
    sealed = deployment.with_name("sealed-master-key.json")
    good = sealed.read_bytes()

    # A wrong token: refused, and the token is never repeated.
    wrong = tmp_path / "wrong-token"
    wrong.write_text("s.not-a-token-4711\n")
    monkeypatch.setenv("CRYPTD_TRANSIT_TOKEN_FILE", str(wrong))
    err = _error(capsys, "keystore", "show")
    assert "refused the token in CRYPTD_TRANSIT_TOKEN_FILE" in err
    assert "4711" not in err
    monkeypatch.setenv("CRYPTD_TRANSIT_TOKEN_FILE", str(bao.token_file))

    # A configuration naming another key than the one that wrapped the file.
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", "cryptd-seal")
    assert "not transit key 'transit/cryptd-seal'" in _error(capsys, "keystore", "show")

    # A ciphertext of another key, labelled as this one: the Transit engine refuses it.
    foreign = TransitSeal(SealSettings(), tmp_path / "other.json")
    try:
        other = foreign.seal_master(secrets.token_bytes(32))
    finally:
        foreign.close()
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", key)
    _rewrite(sealed, ciphertext=base64.b64encode(other.ciphertext).decode())
    assert "refused the wrapped master key" in _error(capsys, "keystore", "show")

    # Altered: a ciphertext byte, or the label the associated data binds it to.
    sealed.write_bytes(good)
    text = base64.b64decode(orjson.loads(good)["ciphertext"]).decode()
    flipped = text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:]
    _rewrite(sealed, ciphertext=base64.b64encode(flipped.encode()).decode())
    assert "refused the wrapped master key" in _error(capsys, "keystore", "show")
    bao.create_key("relabelled")
    sealed.write_bytes(good)
    _rewrite(sealed, key_label="transit/relabelled")
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", "relabelled")
    assert "refused the wrapped master key" in _error(capsys, "keystore", "show")
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", key)

    # Unreachable, a missing mount, then the Transit key deleted.
    sealed.write_bytes(good)
    monkeypatch.setenv("CRYPTD_TRANSIT_ADDRESS", f"http://127.0.0.1:{free_port()}")
    assert "cannot be reached" in _error(capsys, "keystore", "show")
    monkeypatch.setenv("CRYPTD_TRANSIT_ADDRESS", bao.url)
    monkeypatch.setenv("CRYPTD_TRANSIT_MOUNT", "elsewhere")
    assert f"not transit key 'elsewhere/{key}'" in _error(capsys, "keystore", "show")
    monkeypatch.setenv("CRYPTD_SEALED_MASTER_KEY_FILE", str(tmp_path / "new.json"))
    assert "check CRYPTD_TRANSIT_MOUNT" in _error(capsys, "operator", "init")
    assert not (tmp_path / "new.json").exists()
    monkeypatch.delenv("CRYPTD_SEALED_MASTER_KEY_FILE")
    monkeypatch.delenv("CRYPTD_TRANSIT_MOUNT")
    bao.delete_key(key)
    assert f"no Transit key {key!r}" in _error(capsys, "keystore", "show")


def test_settings_name_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYPTD_SEAL", "transit")
    for name in ("CRYPTD_TRANSIT_TOKEN_FILE", "CRYPTD_TRANSIT_CREDENTIAL_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="CRYPTD_TRANSIT_ADDRESS and CRYPTD_TRANSIT_TOKEN_FILE"):
        SealSettings()
    monkeypatch.setenv("CRYPTD_TRANSIT_TOKEN_FILE", "/nonexistent")
    with pytest.raises(ValueError, match="needs CRYPTD_TRANSIT_ADDRESS"):
        SealSettings()
    monkeypatch.setenv("CRYPTD_TRANSIT_CREDENTIAL_FILE", "/nonexistent")
    with pytest.raises(ValueError, match="not both"):
        SealSettings()


def test_status_follows_the_transit_key(
    deployment: Path, key: str, bao: Bao, capsys: pytest.CaptureFixture[str]
) -> None:
    _init(capsys)
    seal = open_seal(SealSettings())
    assert isinstance(seal, TransitSeal)
    try:
        seal.unseal()
        assert seal.status().available
        bao.delete_key(key)
        assert seal.status().available  # cached: /readyz cannot drive Transit calls
        seal._status = None  # the cache's two seconds, skipped
        status = seal.status()
        assert not status.available
        assert status.reason is not None
        assert f"no Transit key {key!r}" in status.reason
        assert not status.sealed  # the master key stays in memory
        with pytest.raises(SealError, match="no Transit key"):
            seal.seal_master(secrets.token_bytes(32))
    finally:
        seal.close()


def test_rotation_wraps_the_new_master_key_with_the_latest_version(
    deployment: Path, key: str, bao: Bao, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _init(capsys)["master_key_id"]
    assert main(["keystore", "init"]) == 0
    assert main(["keys", "create", "--type", "aes256-gcm", "payments"]) == 0
    capsys.readouterr()
    assert main(["operator", "rotate-master-key", "--rotate-transit-key"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report["seal"] == "transit"
    assert report["previous_master_key_id"] == first
    assert report["master_key_id"] != first
    assert bao.latest_version(key) == 2
    sealed = deployment.with_name("sealed-master-key.json")
    ciphertext = base64.b64decode(orjson.loads(sealed.read_bytes())["ciphertext"])
    assert ciphertext.startswith(b"vault:v2:")
    # The old master key stays openable, for backups made under it.
    retired = sealed.with_name(f"sealed-master-key.json.retired-{first}")
    assert retired.exists()
    seal = TransitSeal(SealSettings())
    try:
        files = SealedKeyFiles(seal)
        found = files.find_retired(str(first))
        assert found is not None
        assert found.key_id == first
        assert files.find(report["master_key_id"]) is not None
    finally:
        seal.close()
    # Without the flag: a new master key, the Transit key as it is.
    assert main(["operator", "rotate-master-key"]) == 0
    capsys.readouterr()
    assert bao.latest_version(key) == 2
    assert main(["keystore", "show"]) == 0
    assert orjson.loads(capsys.readouterr().out)["keys"] == 1


def test_another_cryptd_as_transit(
    server: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The development server's aes256-gcm key wraps the master key, through the signing
    client and the credential file ``cryptd serve --dev`` wrote."""
    for name in ("CRYPTD_MASTER_KEY", "CRYPTD_MASTER_KEY_FILE", "CRYPTD_TRANSIT_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CRYPTD_SEAL", "transit")
    monkeypatch.setenv(
        "CRYPTD_TRANSIT_CREDENTIAL_FILE", str(server.directory / "dev" / "client.json")
    )
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", "aes256-gcm")
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(tmp_path / "keyring.json"))
    report = _init(capsys)
    assert report["transit_key"] == "cryptd/aes256-gcm"
    assert report["transit_address"] == server.url
    assert report["transit_key_version"] == 1  # cryptd:v1:
    seal = open_seal(SealSettings())
    try:
        assert MasterKey(seal.unseal()).key_id == report["master_key_id"]
        assert seal.status().available
    finally:
        seal.close()
    assert main(["keystore", "init"]) == 0
    capsys.readouterr()
    # Another key of the peer (same type): the file is not its.
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", "missing-key")
    assert "not transit key 'cryptd/missing-key'" in _error(capsys, "keystore", "show")
    sealed = tmp_path / "sealed-master-key.json"
    _rewrite(sealed, key_label="cryptd/missing-key")
    assert "has no key 'missing-key'" in _error(capsys, "keystore", "show")
    # A ciphertext altered.
    monkeypatch.setenv("CRYPTD_TRANSIT_KEY", "aes256-gcm")
    token = base64.b64decode(orjson.loads(sealed.read_bytes())["ciphertext"]).decode()
    middle = len(token) // 2
    flipped = token[:middle] + ("A" if token[middle] != "A" else "B") + token[middle + 1 :]
    _rewrite(
        sealed,
        key_label="cryptd/aes256-gcm",
        ciphertext=base64.b64encode(flipped.encode()).decode(),
    )
    assert "refused the wrapped master key" in _error(capsys, "keystore", "show")
    bad = tmp_path / "bad-client.json"
    credential = orjson.loads((server.directory / "dev" / "client.json").read_bytes())
    bad.write_bytes(orjson.dumps({**credential, "secret": base64.b64encode(b"x" * 32).decode()}))
    monkeypatch.setenv("CRYPTD_TRANSIT_CREDENTIAL_FILE", str(bad))
    assert "refused the client of CRYPTD_TRANSIT_CREDENTIAL_FILE" in _error(
        capsys, "keystore", "show"
    )


def test_a_pool_process_builds_the_same_seal_from_its_spec(tmp_path: Path) -> None:
    """What crosses to a pool process: the settings (a token file's path, never a token)."""
    settings = SealSettings(
        seal="transit",
        transit_address="https://bao.example:8200",
        transit_token_file=tmp_path / "token",
        transit_mount="secret-transit",
        transit_key="k1",
        transit_ca_file=tmp_path / "ca.pem",
        sealed_master_key_file=tmp_path / "sealed.json",
    )
    files = files_for(settings)
    spec = files_spec(files)
    assert spec is not None
    assert spec[0] == "transit"
    rebuilt = files_from_spec(spec)
    assert isinstance(rebuilt, SealedKeyFiles)
    seal = rebuilt.seal
    assert isinstance(seal, TransitSeal)
    assert seal.sealed_file == tmp_path / "sealed.json"
    for name in ("transit_address", "transit_token_file", "transit_mount", "transit_key",
                 "transit_ca_file", "transit_timeout"):  # fmt: skip
        assert getattr(seal.settings, name) == getattr(settings, name), name


def test_the_transit_certificate_is_verified(
    deployment: Path, bao: Bao, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every test here talks HTTPS to OpenBao, trusted through CRYPTD_TRANSIT_CA_FILE; without
    it the certificate is not trusted and nothing is written."""
    assert bao.url.startswith("https://")
    monkeypatch.delenv("CRYPTD_TRANSIT_CA_FILE")
    assert "cannot be reached" in _error(capsys, "operator", "init")
    assert not deployment.with_name("sealed-master-key.json").exists()
    monkeypatch.setenv("CRYPTD_TRANSIT_CA_FILE", str(deployment.parent / "absent-ca.pem"))
    assert "CRYPTD_TRANSIT_CA_FILE" in _error(capsys, "operator", "init")
