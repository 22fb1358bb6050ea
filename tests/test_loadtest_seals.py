"""The seal benchmarks (``python -m loadtest.seal_parity``, ``python -m loadtest.rotation_load``):
their arithmetic and options, the bulk versions, and one tiny run of each end to end. Never a
timed test: the figures of the smoke runs are not judged, only that every part works."""

from __future__ import annotations

import base64
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest import alternate, rotation_load, seal_parity
from service.keys.admin import create_keyring_file
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.stores import open_store

ROOT = Path(__file__).resolve().parent.parent


def test_parity_is_the_median_ratio_within_the_tolerance() -> None:
    per_round = {
        "aes-encrypt": {
            "static": [1000.0, 1000.0, 1000.0],
            "pkcs11": [990.0, 1100.0, 980.0],
            "shamir": [1000.0, 900.0, 1010.0],
        }
    }
    verdict = seal_parity.judge(per_round, ["pkcs11", "shamir"], 0.05)
    assert verdict["ratios"] == {"aes-encrypt": {"pkcs11": 0.99, "shamir": 1.0}}
    assert verdict["met"] is True
    assert seal_parity.judge(per_round, ["pkcs11"], 0.005)["met"] is False
    assert alternate.median_ratio([2.0, 3.0], [1.0, 1.0]) == 2.5


def test_options_are_checked() -> None:
    assert seal_parity.parse_args([]).seals == ["pkcs11", "shamir"]
    for wrong in (["--seals", "static"], ["--seals", "transit"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            seal_parity.parse_args(wrong)
    assert rotation_load.parse_args([]).versions == 10_000
    with pytest.raises(SystemExit):
        rotation_load.parse_args(["--duration", "1", "--lead", "2"])


def test_the_rotation_verdict() -> None:
    def one(quiet: float, rotating: float, status: int = 200, errors: int = 0) -> dict[str, Any]:
        return {
            "quiet": {"p99_ms": quiet, "errors": 0},
            "rotating": {
                "p99_ms": rotating,
                "errors": errors,
                "rotation_in_window": True,
                "rotation": {"status": status},
            },
        }

    verdict = rotation_load.verdict([one(10, 15), one(10, 30), one(10, 18)])
    assert verdict["p99_ratio"] == 1.8
    assert verdict["met"] is True
    assert rotation_load.verdict([one(10, 15, status=409)])["met"] is False
    assert rotation_load.verdict([one(10, 15, errors=1)])["met"] is False


def test_bulk_versions_are_one_transaction_and_unwrap(tmp_path: Path) -> None:
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    create_keyring_file(tmp_path / "keyring.json", MasterKey(master))
    rotation_load.add_versions(tmp_path, 250, 100)
    manager = KeyManager(open_store(None, tmp_path / "keyring.json"), MasterKey(master))
    manager.load()
    sizes = sorted(len(manager.keyring.key(f"bulk-{n}").versions) for n in range(3))
    assert sizes == [50, 100, 100]
    assert manager.keyring.generation == 2  # created, then one change
    manager.store.close()


def _run(module: str, *options: str, out: Path) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed (apt-get install -y wrk)")
    command = [sys.executable, "-m", module, *options, "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: goal missed on a busy machine
    report: dict[str, Any] = orjson.loads(out.read_bytes())
    return report


@pytest.mark.slow
def test_a_tiny_parity_run_end_to_end(tmp_path: Path) -> None:
    report = _run(
        "loadtest.seal_parity",
        *("--rounds", "1", "--duration", "1", "--connections", "2"),
        *("--scenarios", "aes-encrypt"),
        out=tmp_path / "parity.json",
    )
    rounds = report["rounds"]
    assert isinstance(rounds, dict)
    for seal in ("static", "pkcs11", "shamir"):
        assert rounds["aes-encrypt"][seal][0] > 0, seal


@pytest.mark.slow
def test_a_tiny_rotation_run_end_to_end(tmp_path: Path) -> None:
    report = _run(
        "loadtest.rotation_load",
        *("--versions", "500", "--rounds", "1", "--duration", "2", "--lead", "0.3"),
        *("--connections", "2"),
        out=tmp_path / "rotation.json",
    )
    [found] = report["rounds"]
    assert found["rotating"]["rotation"]["status"] == 200
    assert found["rotating"]["rotation"]["versions"] >= 500
    assert found["quiet"]["errors"] == found["rotating"]["errors"] == 0
    assert report["clean"] is True
