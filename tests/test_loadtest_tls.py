"""The TLS comparison (``python -m loadtest.tls``): its goals at their boundaries, the
report it writes, and one short run against every server plain and over TLS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadtest import tls, tls_rounds
from loadtest.measure import Measurement
from loadtest.report import MixResult, summarize
from loadtest.scenarios import MIX_BY_NAME, OPENBAO_KEYS
from loadtest.targets import OpenBao, find_bao

ROOT = Path(__file__).resolve().parent.parent


def _m(rps: float, cpu_us: float, errors: int = 0) -> Measurement:
    requests = round(rps * 10)
    return Measurement(
        requests=requests,
        seconds=10.0,
        errors=errors,
        p50_ms=1.0,
        p99_ms=4.0,
        mean_ms=1.5,
        max_ms=9.0,
        server_cpu_s=requests * cpu_us / 1e6,
    )


def _pair(plain: Measurement, on: Measurement) -> tls.Pair:
    return tls.Pair(summarize([plain], 1), summarize([on], 1), 1)


def test_pair_reports_the_throughput_kept_and_the_cpu_added() -> None:
    pair = _pair(_m(4000, 150), _m(3000, 170))
    assert pair.tls_ratio == pytest.approx(0.75)
    assert pair.added_us == pytest.approx(20)


@pytest.mark.parametrize(
    ("cryptd_tls_us", "bao_tls_rps", "expected"),
    [
        (170.0, 2000.0, {"openbao": True, "hot_path": True, "no_errors": True}),  # both equal
        (170.1, 2000.0, {"openbao": True, "hot_path": False, "no_errors": True}),
        (170.0, 2001.0, {"openbao": False, "hot_path": True, "no_errors": True}),
    ],
)
def test_goals_at_their_boundaries(
    cryptd_tls_us: float, bao_tls_rps: float, expected: dict[str, bool]
) -> None:
    # cryptd 4,000 -> 3,000 req/s (ratio 2.0 -> 1.5 against OpenBao 2,000 -> 2,000 * 0.75);
    # TLS adds 20 us to the bare app's request and, at 170 us, 20 us to cryptd's.
    result = tls.ScenarioResult(
        "aes-encrypt",
        "AES",
        {
            "cryptd": _pair(_m(4000, 150), _m(3000, cryptd_tls_us)),
            "bare": _pair(_m(20000, 40), _m(15000, 60)),
            "openbao": _pair(_m(2000, 300), _m(bao_tls_rps * 0.75, 330)),
        },
    )
    assert result.ratio(False) == pytest.approx(2.0)
    assert result.goals() == expected
    table = tls.openbao_table([result])
    assert ("| PASS |" in table) == expected["openbao"]
    assert "| bare ASGI |" in tls.hot_path_table(result)


def test_errors_fail_the_run_and_a_scenario_without_openbao_has_no_ratio() -> None:
    result = tls.ScenarioResult(
        "sm2-sign", "SM2", {"cryptd": _pair(_m(1000, 900), _m(990, 905, errors=1))}
    )
    assert result.ratio(True) is None
    assert result.goals() == {"no_errors": False}


def test_plan_takes_every_scenario_openbao_runs_and_the_mix_by_default() -> None:
    plan = tls.make_plan(tls.parse_args(["--shared-cores"]))
    assert "aes-encrypt" in plan.scenarios
    assert "sm2-sign" not in plan.scenarios
    assert plan.mixes == ("mix",)
    chosen = tls.make_plan(tls.parse_args(["--shared-cores", "--scenarios", "aes-encrypt"]))
    assert chosen.scenarios == ("aes-encrypt",)
    assert chosen.mixes == ()
    with pytest.raises(SystemExit):
        tls.make_plan(tls.parse_args(["--shared-cores", "--scenarios", "nope"]))


def test_the_mix_over_tls_is_reported_with_its_goals() -> None:
    """The cheap stream beside the costly one against its P99 alone, both targets over TLS."""
    slow = Measurement(
        requests=1000, seconds=10.0, errors=0, p50_ms=2.0, p99_ms=9.0, mean_ms=3.0, max_ms=20.0
    )
    mix = MixResult(
        MIX_BY_NAME["mix"],
        {
            "cryptd": [{"aes-encrypt": _m(3000, 100), "rsa-sign": _m(900, 400)}],
            "openbao": [{"aes-encrypt": _m(1000, 300), "rsa-sign": slow}],
        },
        {"cryptd": [_m(6000, 100)], "openbao": [_m(4000, 120)]},
        1,
    )
    # _m's P99 is 4 ms whatever the load: beside RSA as alone, within 2x.
    assert mix.goals() == {
        "aes-encrypt throughput": True,
        "rsa-sign throughput": True,
        "aes-encrypt P99": True,
    }
    result = {
        "config": {
            "production": True, "topology": "pinned", "threads": 1, "connections": 16,
            "duration": 8.0, "rounds": 1, "workers": 1, "command": "python -m loadtest.tls",
        },
        "tls": {"cryptd": "TLSv1.3 TLS_AES_128_GCM_SHA256"},
        "started": "now",
        "machine": {"git_head": "abc", "loadavg": ["0.1", "0.1", "0.1"]},
    }  # fmt: skip
    text = tls.summary(result, [], [mix])
    assert "Mixed traffic over TLS (cryptd and OpenBao each over its own TLS)" in text
    assert "| aes-encrypt | 8 | 3,000 | 1,000 | 3.00x |" in text
    assert "aes-encrypt P99 PASS" in text
    assert "Mixed traffic" not in tls.summary(result, [])


@pytest.mark.slow
def test_every_server_plain_and_over_tls_in_one_short_run(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("wrk is required under CI (apt-get install -y wrk luajit)")
        pytest.skip("wrk is not installed (apt-get install -y wrk luajit)")
    try:
        find_bao()
    except RuntimeError:
        pytest.skip("OpenBao is not installed (pip install -e '.[load]')")
    out, report = tmp_path / "result.json", tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.tls", "--quick", "--duration", "1", "--production",
         "--scenarios", "aes-encrypt,mix", "--connections", "2", "--quiet", "0",
         "--json", str(out), "--markdown", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = orjson.loads(out.read_bytes())
    # Every server answered over TLS 1.3 (wrk speaks https) and in clear text, without errors:
    # cryptd's signed requests verified over both, OpenBao with its own -dev-tls listener.
    assert set(result["tls"]) == {"cryptd", "bare", "openbao"}
    assert all(v.startswith("TLSv1.3 ") for v in result["tls"].values())
    assert result["tls"]["cryptd"] == "TLSv1.3 TLS_AES_128_GCM_SHA256"
    # Production's cryptd: replay store on the run's own Redis, audit to a file, fail-closed.
    env = result["config"]["cryptd_env"]
    assert env["CRYPTD_REDIS_URL"].startswith("redis://127.0.0.1:")
    assert env["CRYPTD_REDIS_URL"] != "redis://127.0.0.1:6379/0"
    assert env["CRYPTD_AUDIT_LOG"].endswith("audit.log")
    assert env["CRYPTD_AUDIT_FAIL_CLOSED"] == "true"
    assert result["config"]["production"] is True
    assert result["config"]["openbao_audit"] is True
    assert 10 < result["phase"]["before"] < 100_000
    # The bare app uses cryptd's TLS context: the same suite.
    assert result["tls"]["bare"] == result["tls"]["cryptd"]
    runs = result["runs"]["aes-encrypt"]
    assert set(runs) == {
        f"{kind}-{mode}" for kind in ("cryptd", "bare", "openbao") for mode in ("plain", "tls")
    }
    for key, (m,) in runs.items():
        assert m["requests"] > 0, key
        assert m["errors"] == 0, key
        assert m["server_cpu_s"] > 0, key
    (row,) = result["results"]
    assert set(row["pairs"]) == {"cryptd", "bare", "openbao"}
    assert set(row["goals"]) == {"openbao", "hot_path", "no_errors"}
    section = report.read_text()
    assert "| bare ASGI |" in section
    assert "| AES-256-GCM encrypt 1 KiB |" in section
    assert "python -m loadtest.tls --quick --duration 1 --production" in section
    assert "replay protection on a Redis of its own" in section
    assert "Host phase: RSA-2048 PSS sign" in section
    assert "OpenBao with its file audit device" in section
    assert "| AES-256-GCM encrypt 1 KiB | " in section.split("in every round")[1]
    # The mix over TLS: both streams against both targets, and the cheap stream alone.
    (mix,) = result["mixes"]
    for stream in ("aes-encrypt", "rsa-sign"):
        for target in ("cryptd", "openbao"):
            assert mix["streams"][stream][target]["ops"] > 0, (stream, target)
    assert mix["alone"]["cryptd"]["ops"] > 0
    assert mix["alone"]["openbao"]["ops"] > 0
    assert set(mix["goals"]) == {"aes-encrypt throughput", "rsa-sign throughput", "aes-encrypt P99"}
    assert "Mixed traffic over TLS" in section
    assert "| rsa-sign | 8 |" in section


@pytest.mark.slow
def test_openbao_with_its_audit_device_records_each_request_without_the_plaintext(
    tmp_path: Path,
) -> None:
    """Production's OpenBao: its file audit device writes a request and a response entry for a
    Transit call over its TLS listener, the plaintext HMAC'd."""
    try:
        find_bao()
    except RuntimeError:
        if os.environ.get("CI") == "true":
            pytest.fail("OpenBao is required under CI (pip install -e '.[load]')")
        pytest.skip("OpenBao is not installed (pip install -e '.[load]')")
    bao = OpenBao(tmp_path / "bao", tls=True, audit=True)
    try:
        bao.start()
        key = next(name for name, kind in OPENBAO_KEYS.items() if kind == "aes256-gcm96")
        plaintext = "c2VjcmV0LW1hcmtlci00MjQy"  # base64 of secret-marker-4242
        status, _ = bao.request(f"/v1/transit/encrypt/{key}", {"plaintext": plaintext})
        assert status == 200
    finally:
        bao.stop()
    entries = [orjson.loads(line) for line in bao.audit_log.read_bytes().splitlines()]
    ours = [e for e in entries if e["request"].get("path") == f"transit/encrypt/{key}"]
    assert [e["type"] for e in ours] == ["request", "response"]
    assert ours[0]["request"]["data"]["plaintext"].startswith("hmac-sha256:")
    assert plaintext.encode() not in bao.audit_log.read_bytes()


def test_every_rounds_ratios_are_reported_in_round_order() -> None:
    def run(ops: float) -> dict[str, float]:
        return {"ops": ops}

    runs = {
        "aes-encrypt": {
            "cryptd-plain": [run(300), run(200)],
            "openbao-plain": [run(100), run(100)],
            "cryptd-tls": [run(150), run(240)],
            "openbao-tls": [run(100), run(0)],
        },
        "sm2-sign": {"cryptd-plain": [run(50)], "cryptd-tls": [run(40)]},  # no OpenBao
    }
    table = tls_rounds.rounds_table(runs, 2)
    lines = table.splitlines()
    assert lines[2] == "| AES-256-GCM encrypt 1 KiB | 3.00 / 2.00 | 1.50 / - |"
    assert len(lines) == 3  # the scenario OpenBao does not run has no row


def test_production_runs_five_rounds_unless_told_and_names_its_settings(tmp_path: Path) -> None:
    assert tls.make_plan(tls.parse_args(["--production", "--shared-cores"])).rounds == 5
    assert tls.make_plan(tls.parse_args(["--production", "--rounds", "2"])).rounds == 2
    assert tls.make_plan(tls.parse_args(["--shared-cores"])).rounds == 3
    env = tls.production_env(tmp_path, "redis://127.0.0.1:7000/0")
    assert env == {
        "CRYPTD_REDIS_URL": "redis://127.0.0.1:7000/0",
        "CRYPTD_AUDIT_LOG": str(tmp_path / "audit.log"),
        "CRYPTD_AUDIT_FAIL_CLOSED": "true",
        "CRYPTD_METRICS": "true",
    }
