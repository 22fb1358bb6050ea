"""``cryptd bench``: the command runs end to end and reports every figure it promises.

No timing is asserted: the figures depend on the machine; only their presence and consistency."""

from __future__ import annotations

import orjson
import pytest

from loadtest.algorithms import rates
from loadtest.algorithms.table import render
from service.cli import main

pytestmark = pytest.mark.slow  # benchmark runs


def test_measure_counts_calls_on_one_and_several_threads() -> None:
    calls: list[int] = []
    rate, iterations = rates.measure(lambda: calls.append(1), 0.01)
    assert iterations >= 1
    assert rate > 0
    assert len(calls) == iterations + 1  # plus the warm-up call
    rate, iterations = rates.measure(lambda: calls.append(1), 0.01, threads=3)
    assert iterations >= 3
    counts: dict[str, int] = {"a": 0, "b": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    figures = rates.compare(
        {"a": (lambda: bump("a"), 1), "b": (lambda: bump("b"), 2)}, 0.02, rounds=4
    )
    for name, (rate, iterations) in figures.items():
        assert rate > 0
        assert iterations + 1 == counts[name]  # plus the warm-up call


@pytest.fixture(scope="module")
def report() -> rates.Report:
    return rates.run(seconds=0.01, sizes=(16, 1024), threads=2, rounds=2)


def test_report_covers_the_article_table(report: rates.Report) -> None:
    for operation in rates.OPERATIONS:
        for backend in ("sm2", "rsa-2048", "gmssl"):
            assert report.rate(backend, operation) is not None, (backend, operation)
    for backend in ("ecdsa-p256", "ed25519"):
        assert report.rate(backend, "sign") is not None
        assert report.rate(backend, "encrypt") is None
    for size in (16, 1024):
        for backend in rates.PAYLOAD_BACKENDS:
            for operation in ("encrypt", "decrypt"):
                assert report.rate(backend, operation, size) is not None
    for operation in rates.REFERENCE_OPERATIONS:
        assert report.rate(rates.THREADS, operation, threads=1) is not None
        assert report.rate(rates.THREADS, operation, threads=2) is not None


def test_ratios_and_references_follow_from_the_rates(report: rates.Report) -> None:
    ratios = rates.ratios(report)
    sm2, rsa, gmssl = (report.rate(b, "sign") for b in ("sm2", "rsa-2048", "gmssl"))
    assert sm2 is not None
    assert rsa is not None
    assert gmssl is not None
    assert ratios["sign"]["sm2/rsa-2048"] == pytest.approx(sm2 / rsa)
    assert ratios["sign"]["sm2/gmssl"] == pytest.approx(sm2 / gmssl)
    references = {g["operation"]: g for g in rates.references(report)}
    assert set(references) == set(rates.REFERENCE_OPERATIONS)
    rsa_private = report.rate(rates.RSA_PRIVATE, "sign")
    assert rsa_private is not None
    assert references["sign"]["rsa_private"] == rsa_private
    assert references["sign"]["vs_rsa_private"] == pytest.approx(sm2 / rsa_private)
    assert references["sign"]["vs_gmssl"] == pytest.approx(sm2 / gmssl)


def test_table_rendering(report: rates.Report) -> None:
    text = render(report)
    for label in ("SM2/RSA-2048", "SM2/gmssl", "ECDSA-P256", "Ed25519", "1 KiB", "SM2 against"):
        assert label in text
    assert "2 threads" in text


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--seconds", "0.005", "--sizes", "16", "--threads", "1", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert set(data) == {"seconds", "meta", "results", "ratios", "references", "sizes"}
    assert data["meta"]["libcrypto"].startswith("OpenSSL 3.")
    backends = {r["backend"] for r in data["results"]}
    assert {"sm2", "rsa-2048", "ecdsa-p256", "ed25519", "gmssl", "sm2-hybrid"} <= backends
    assert all(r["iterations"] >= 1 and r["ops_per_s"] > 0 for r in data["results"])


def test_cli_without_gmssl_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "--seconds", "0.005", "--sizes", "16", "--no-gmssl", "--threads", "1"]) == 0
    )
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "SM2/RSA-2048" in line)
    assert "gmssl " not in header  # no gmssl column
    with pytest.raises(SystemExit):
        main(["bench", "--sizes", "0"])
    assert main(["bench", "--seconds", "0"]) == 2  # refused before measuring anything
