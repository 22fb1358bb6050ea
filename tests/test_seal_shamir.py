"""The Shamir seal (service/seal/shamir.py): splitting, share checks, progress, the CLI."""

from __future__ import annotations

import base64
import io
import itertools
import secrets
from pathlib import Path

import orjson
import pytest

from service.cli import main
from service.keys.masterkey import MasterKey
from service.seal import SealError
from service.seal.shamir import ShamirSeal, ShareRefused, split


@pytest.fixture
def seal_file(tmp_path: Path) -> Path:
    return tmp_path / "sealed-master-key.json"


def _tamper(share: str) -> str:
    words = share.split()
    words[5] = "academic" if words[5] != "academic" else "acid"
    return " ".join(words)


def test_any_threshold_of_the_shares_rebuilds_the_key(seal_file: Path) -> None:
    master = secrets.token_bytes(32)
    shares = split(seal_file, 5, 3, master)
    assert len(shares) == len(set(shares)) == 5
    assert all(len(share.split()) == 33 for share in shares)
    stored = seal_file.read_text()
    assert all(word not in stored for word in shares[0].split()[4:8])  # no share at rest
    assert orjson.loads(stored)["key_id"] == MasterKey(master).key_id
    for chosen in itertools.combinations(shares, 3):
        seal = ShamirSeal(seal_file)
        assert seal.status().sealed
        for count, share in enumerate(chosen, 1):
            status = seal.submit(share)
            assert status.progress == (count if count < 3 else 0)
        assert not seal.status().sealed
        assert seal.unseal() == master


def test_a_fresh_master_key_by_default(tmp_path: Path) -> None:
    first = split(tmp_path / "a.json", 2, 2)
    second = split(tmp_path / "b.json", 2, 2)
    a, b = ShamirSeal(tmp_path / "a.json"), ShamirSeal(tmp_path / "b.json")
    for seal, shares in ((a, first), (b, second)):
        for share in shares:
            seal.submit(share)
    assert a.unseal() != b.unseal()


def test_sealed_until_the_threshold(seal_file: Path) -> None:
    shares = split(seal_file, 3, 2)
    seal = ShamirSeal(seal_file)
    with pytest.raises(SealError, match="sealed: 2 operators must submit"):
        seal.unseal()
    seal.submit(shares[0])
    with pytest.raises(SealError, match="sealed"):
        seal.unseal()


@pytest.mark.parametrize("bad", ["tampered", "foreign", "repeated", "garbage", "too_long"])
def test_a_refused_share_is_counted_and_keeps_the_progress(
    seal_file: Path, tmp_path: Path, bad: str
) -> None:
    master = secrets.token_bytes(32)
    shares = split(seal_file, 3, 3, master)
    # The same master key split again is still another split: its shares are foreign.
    foreign = split(tmp_path / "other.json", 3, 3, master)[1]
    seal = ShamirSeal(seal_file)
    seal.submit(shares[0])
    seal.submit(shares[1])
    candidate = {
        "tampered": _tamper(shares[2]),
        "foreign": foreign,
        "repeated": shares[1],
        "garbage": "not a share at all",
        "too_long": "word " * 400,
    }[bad]
    with pytest.raises(ShareRefused) as refused:
        seal.submit(candidate)
    assert refused.value.code == "invalid_request"
    # The message never quotes the share (the library's own text would).
    if len(candidate.split()) == 33:
        assert " ".join(candidate.split()[:3]) not in refused.value.message
    status = seal.status()
    assert (status.sealed, status.progress, status.refused) == (True, 2, 1)
    seal.submit(shares[2])
    assert seal.unseal() == master


def test_shares_are_normalised(seal_file: Path) -> None:
    master = secrets.token_bytes(32)
    shares = split(seal_file, 2, 2, master)
    seal = ShamirSeal(seal_file)
    seal.submit("  " + shares[0].upper().replace(" ", "\n ") + "\n")
    seal.submit(shares[1])
    assert seal.unseal() == master


def test_shares_that_do_not_rebuild_the_recorded_key_start_over(seal_file: Path) -> None:
    shares = split(seal_file, 3, 2)
    document = orjson.loads(seal_file.read_bytes())
    document["key_id"] = "00" * 8  # as if a share were forged with a valid checksum
    seal_file.write_bytes(orjson.dumps(document))
    seal = ShamirSeal(seal_file)
    seal.submit(shares[0])
    with pytest.raises(ShareRefused, match="do not rebuild this deployment's master key"):
        seal.submit(shares[1])
    status = seal.status()
    assert (status.sealed, status.progress, status.refused) == (True, 0, 1)


def test_split_refusals(seal_file: Path) -> None:
    for shares, threshold in ((3, 4), (17, 2), (0, 0), (3, 1)):
        with pytest.raises(SealError):
            split(seal_file, shares, threshold)
    assert not seal_file.exists()
    split(seal_file, 2, 2)
    with pytest.raises(SealError, match="already exists"):
        split(seal_file, 2, 2)


def test_missing_or_foreign_seal_file(seal_file: Path) -> None:
    with pytest.raises(SealError, match="operator init --shares N --threshold K"):
        ShamirSeal(seal_file)
    seal_file.write_text('{"format": "cryptd-sealed-master-key/1"}')
    with pytest.raises(SealError, match="is not a Shamir seal"):
        ShamirSeal(seal_file)


# -- the CLI --------------------------------------------------------------------------------


@pytest.fixture
def shamir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("CRYPTD_MASTER_KEY", "CRYPTD_MASTER_KEY_FILE", "CRYPTD_KEYSTORE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CRYPTD_SEAL", "shamir")
    keyring = tmp_path / "keyring.json"
    monkeypatch.setenv("CRYPTD_KEYRING_FILE", str(keyring))
    return keyring


def test_operator_init_prints_the_shares_once(
    shamir_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["operator", "init", "--shares", "3", "--threshold", "2", "--json"]) == 0
    out = capsys.readouterr()
    shares = orjson.loads(out.out)["shares"]
    assert len(shares) == 3
    assert "any 2 unseal" in out.err
    assert main(["operator", "init", "--shares", "3", "--threshold", "2"]) == 1
    assert "already exists" in capsys.readouterr().err
    # Offline commands unseal with shares on stdin: a refused one is said, the next taken.
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{shares[2]}\n{shares[2]}\n{shares[0]}\n"))
    assert main(["keystore", "init"]) == 0
    captured = capsys.readouterr()
    assert "share refused: this share was already submitted" in captured.err
    # No part of the share is echoed: three of its words in a row would be (a single word
    # could be part of the message itself: "already", "fused" and "submit" are share words).
    words = shares[2].split()
    for start in range(len(words) - 2):
        assert " ".join(words[start : start + 3]) not in captured.err
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{shares[1]}\n"))
    assert main(["keystore", "show"]) == 1
    assert "stdin ended after 1 of 2 shares" in capsys.readouterr().err


def test_operator_init_text_output_and_argument_checks(
    shamir_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["operator", "init"]) == 1
    assert "give --shares N --threshold K" in capsys.readouterr().err
    assert main(["operator", "init", "--shares", "3"]) == 1
    assert "go together" in capsys.readouterr().err
    master = secrets.token_bytes(32)
    key_file = shamir_env.parent / "master.key"
    key_file.write_text(base64.b64encode(master).decode())
    argv = ["operator", "init", "--shares", "2", "--threshold", "2"]
    assert main([*argv, "--master-key-file", str(key_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    seal = ShamirSeal(shamir_env.with_name("sealed-master-key.json"))
    for line in lines:
        seal.submit(line)
    assert seal.unseal() == master
    monkeypatch.setenv("CRYPTD_SEAL", "static")
    assert main(["operator", "init", "--shares", "2", "--threshold", "2"]) == 1
    assert "CRYPTD_SEAL=shamir only" in capsys.readouterr().err
