"""``cryptd operator seal-migrate``: the same master key under another seal, the key store
untouched, and a SIGKILL at any moment leaving the old or the new seal working."""

from __future__ import annotations

import base64
import io
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from service.cli import main
from service.keys.masterkey import MasterKey
from service.seal import pkcs11 as pkcs11_seal
from tests.test_seal_support import SOFTHSM_MODULE, Token, make_store, make_token
from tests.transit_support import Bao

pytestmark = pytest.mark.slow  # starts OpenBao

SEAL_VARIABLES = ("CRYPTD_SEAL", "CRYPTD_MASTER_KEY", "CRYPTD_MASTER_KEY_FILE")


@pytest.fixture(scope="module")
def bao(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bao]:
    made = Bao(tmp_path_factory.mktemp("openbao")).start()
    yield made
    made.stop()


@pytest.fixture
def token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Token:
    made = make_token(tmp_path / "hsm")
    monkeypatch.setenv("SOFTHSM2_CONF", str(made.conf))
    pkcs11_seal.reinitialize(SOFTHSM_MODULE)
    return made


@pytest.fixture
def static(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, Path]:
    """A static deployment: the master key in a file, a key store under it."""
    for name in (*SEAL_VARIABLES, "CRYPTD_KEYSTORE_URL", "CRYPTD_SEALED_MASTER_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    master = secrets.token_bytes(32)
    make_store(tmp_path, master)
    key_file = tmp_path / "master.key"
    key_file.write_text(base64.b64encode(master).decode() + "\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(tmp_path / "keyring.json"))
    monkeypatch.setenv("CRYPTD_MASTER_KEY_FILE", str(key_file))
    return master, key_file


def _use(monkeypatch: pytest.MonkeyPatch, seal: str, extra: dict[str, str]) -> None:
    for name in SEAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CRYPTD_SEAL", seal)
    for name, value in extra.items():
        if name != "CRYPTD_SEAL":
            monkeypatch.setenv(name, value)


def _migrate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, object], str]:
    code = main(["operator", "seal-migrate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return orjson.loads(out), err


def _opens(capsys: pytest.CaptureFixture[str]) -> bool:
    """The key store opens under the seal the environment names."""
    code = main(["keystore", "show"])
    out = capsys.readouterr().out
    return code == 0 and orjson.loads(out)["keys"] == 1


def test_static_to_transit_to_pkcs11_to_static_keeps_the_store_as_it_is(
    static: tuple[bytes, Path],
    bao: Bao,
    token: Token,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    master, key_file = static
    key_id = MasterKey(master).key_id
    keyring = (tmp_path / "keyring.json").read_bytes()
    sealed = tmp_path / "sealed-master-key.json"
    for name, value in bao.env().items():
        if name != "CRYPTD_SEAL":
            monkeypatch.setenv(name, value)
    for name, value in token.env().items():
        if name != "CRYPTD_SEAL":
            monkeypatch.setenv(name, value)

    # static -> transit: the sealed file written, the key file left for the operator.
    report, err = _migrate(capsys, "--to", "transit")
    assert report == {
        "from": "static", "to": "transit", "master_key_id": key_id, "written": str(sealed),
        "previous": str(key_file),
    }  # fmt: skip
    assert f"remove {key_file}" in err
    assert key_file.exists()
    assert _opens(capsys)  # the old seal still works
    _use(monkeypatch, "transit", {})
    assert _opens(capsys)  # and the new one
    # Again: nothing to do, it says so.
    _use(monkeypatch, "static", {"CRYPTD_MASTER_KEY_FILE": str(key_file)})
    again, _ = _migrate(capsys, "--to", "transit")
    assert again["already_migrated"] is True
    key_file.unlink()

    # transit -> pkcs11: one file for both, replaced atomically, the old copied aside.
    _use(monkeypatch, "transit", {})
    report, err = _migrate(capsys, "--to", "pkcs11")
    assert report["previous_copied_to"] == str(sealed) + ".from-transit"
    assert orjson.loads(sealed.read_bytes())["seal"] == "pkcs11"
    assert (
        orjson.loads((tmp_path / "sealed-master-key.json.from-transit").read_bytes())["seal"]
        == "transit"
    )
    _use(monkeypatch, "pkcs11", {})
    assert _opens(capsys)

    # pkcs11 -> static, with a warning: the key is in a plain file again.
    back = tmp_path / "back.key"
    report, err = _migrate(capsys, "--to", "static", "--master-key-file", str(back))
    assert "warning: the master key is now in a plain file" in err
    assert base64.b64decode(back.read_text()) == master
    assert back.stat().st_mode & 0o777 == 0o600
    _use(monkeypatch, "static", {"CRYPTD_MASTER_KEY_FILE": str(back)})
    assert _opens(capsys)
    # No key version was rewrapped on the way.
    assert (tmp_path / "keyring.json").read_bytes() == keyring


def test_to_and_from_shamir(
    static: tuple[bytes, Path],
    bao: Bao,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    master, _ = static
    report, _ = _migrate(capsys, "--to", "shamir", "--shares", "3", "--threshold", "2")
    shares = report["shares"]
    assert isinstance(shares, list)
    assert len(shares) == 3
    split = orjson.loads((tmp_path / "sealed-master-key.json").read_bytes())
    assert split["key_id"] == MasterKey(master).key_id
    # shamir -> transit: two operators' shares on stdin.
    _use(monkeypatch, "shamir", bao.env())
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{shares[2]}\n{shares[0]}\n"))
    report, _ = _migrate(capsys, "--to", "transit")
    assert report["previous_copied_to"] == str(tmp_path / "sealed-master-key.json.from-shamir")
    _use(monkeypatch, "transit", bao.env())
    assert _opens(capsys)


def test_refusals_leave_everything_as_it_was(
    static: tuple[bytes, Path],
    bao: Bao,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, key_file = static
    for args, expected in (
        (["--to", "static", "--master-key-file", "x"], "already uses CRYPTD_SEAL=static"),
        (["--to", "shamir"], "--to shamir needs --shares N --threshold K"),
        (["--to", "transit", "--shares", "2", "--threshold", "2"], "for --to shamir only"),
    ):
        assert main(["operator", "seal-migrate", *args]) == 1
        assert expected in capsys.readouterr().err
    # The Transit service refuses: nothing written.
    for name, value in bao.env().items():
        if name != "CRYPTD_SEAL":
            monkeypatch.setenv(name, value)
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    monkeypatch.setenv("CRYPTD_TRANSIT_TOKEN_FILE", str(wrong))
    assert main(["operator", "seal-migrate", "--to", "transit"]) == 1
    assert "refused the token" in capsys.readouterr().err
    assert not (tmp_path / "sealed-master-key.json").exists()
    # A master key that does not open the key store is never moved.
    monkeypatch.setenv("CRYPTD_TRANSIT_TOKEN_FILE", str(bao.token_file))
    key_file.write_text(base64.b64encode(secrets.token_bytes(32)).decode())
    assert main(["operator", "seal-migrate", "--to", "transit"]) == 1
    capsys.readouterr()
    assert not (tmp_path / "sealed-master-key.json").exists()


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_sigkill_leaves_the_old_or_the_new_seal_working(
    static: tuple[bytes, Path],
    bao: Bao,
    token: Token,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """transit -> pkcs11 shares one file: killed at points spread over a run, the key store
    always opens under the old seal or under the new one, and a second run finishes."""
    _, key_file = static
    for name, value in {**bao.env(), **token.env()}.items():
        if name != "CRYPTD_SEAL":
            monkeypatch.setenv(name, value)
    _migrate(capsys, "--to", "transit")
    key_file.unlink()
    sealed = tmp_path / "sealed-master-key.json"
    original = sealed.read_bytes()
    _use(monkeypatch, "transit", {})
    source = dict(os.environ)

    started = time.monotonic()
    assert _cli(source, "operator", "seal-migrate", "--to", "pkcs11").returncode == 0
    whole = time.monotonic() - started
    for step in range(4):
        sealed.write_bytes(original)  # back to transit
        for leftover in tmp_path.glob("sealed-master-key.json.*"):
            leftover.unlink()
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "operator", "seal-migrate", "--to", "pkcs11"],
            env=source, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(whole * (0.6 + 0.12 * step))
        process.send_signal(signal.SIGKILL)
        process.wait()
        _use(monkeypatch, "transit", {})
        old = _opens(capsys)
        _use(monkeypatch, "pkcs11", {})
        new = _opens(capsys)
        assert old or new, f"neither seal opens the store after a kill at step {step}"
        # Run again (under the old seal's settings, as an operator would): it finishes.
        _use(monkeypatch, "transit", {})
        report, _ = _migrate(capsys, "--to", "pkcs11")
        assert report["master_key_id"] is not None
        _use(monkeypatch, "pkcs11", {})
        assert _opens(capsys)


def test_what_a_cut_run_leaves_is_finished_by_the_next(
    static: tuple[bytes, Path],
    bao: Bao,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The states a SIGKILL can leave in a migration between seals sharing a file: a partial
    ``.migrating`` (the old file still in place and working), then the copy aside made too."""
    master, key_file = static
    for name, value in bao.env().items():
        if name != "CRYPTD_SEAL":
            monkeypatch.setenv(name, value)
    made, _ = _migrate(capsys, "--to", "shamir", "--shares", "2", "--threshold", "2")
    shares = made["shares"]
    assert isinstance(shares, list)
    sealed = tmp_path / "sealed-master-key.json"
    split = sealed.read_bytes()
    key_file.unlink()
    (tmp_path / "sealed-master-key.json.migrating").write_bytes(b'{"format": "cryptd-sea')
    (tmp_path / "sealed-master-key.json.from-shamir").write_bytes(split)
    assert sealed.read_bytes() == split  # the old seal's file, as the old seal reads it
    _use(monkeypatch, "shamir", {})
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(share + "\n" for share in shares)))
    report, _ = _migrate(capsys, "--to", "transit", "--sealed-file", str(sealed))
    assert report["master_key_id"] == MasterKey(master).key_id
    assert not (tmp_path / "sealed-master-key.json.migrating").exists()
    _use(monkeypatch, "transit", {})
    assert _opens(capsys)
