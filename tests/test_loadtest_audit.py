"""The audit-cost benchmark (``python -m loadtest.audit_cost``): its arithmetic, its options,
and one tiny run end to end (two servers, wrk, the trail verified). Never a timed test: the
figures of the smoke run are not judged, only that every part works."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadtest import audit_groups
from loadtest.audit_cost import GOAL, Report, Round, markdown, parse_args

ROOT = Path(__file__).resolve().parent.parent


def test_the_cost_is_one_minus_the_median_ratio() -> None:
    report = Report("pinned", "fast")
    report.rounds = [Round(1000, 950), Round(1000, 800), Round(1000, 900)]
    assert report.cost == pytest.approx(0.10)
    report.verify_exit = 0
    assert report.summary()["met"] is (report.cost <= GOAL)
    report.verify_exit = 1  # a trail that does not verify fails the goal whatever the speed
    assert report.summary()["met"] is False


def test_a_baseline_tree_gets_its_own_cost_from_the_same_rounds() -> None:
    report = Report("pinned", "fast", baseline="/elsewhere")
    report.rounds = [Round(1000, 950, 500), Round(1000, 800, 700), Round(1000, 900, 600)]
    assert report.baseline_cost == pytest.approx(0.40)
    assert report.summary()["baseline_cost"] == pytest.approx(0.40)
    alone = Report("pinned", "fast", rounds=[Round(1000, 950)])
    assert alone.summary()["baseline_cost"] is None
    text = markdown(report, parse_args(["--baseline", "/elsewhere"]), "now")
    assert "**cost 40.0%**" in text
    assert "500 (0.500), 700 (0.700), 600 (0.600)" in text


def test_the_memory_file_system_server_gets_its_cost_and_every_server_its_cpu() -> None:
    """``--memory-dir``: the trail without the disk's syncs, from the same rounds; each
    round's CPU per request is reported by server."""
    report = Report("pinned", "fast", memory_dir="/dev/shm/x")
    report.rounds = [
        Round(1000, 700, memory_ops=900, cpu_us={"audit-off": 100.0, "audited": 150.5}),
        Round(1000, 600, memory_ops=800, cpu_us={"audit-off": 101.0, "audited": 160.0}),
        Round(1000, 650, memory_ops=850),
    ]
    assert report.memory_cost == pytest.approx(0.15)
    assert report.summary()["memory_cost"] == pytest.approx(0.15)
    assert Report("pinned", "fast", rounds=report.rounds).memory_cost is None
    text = markdown(report, parse_args(["--memory-dir", "/dev/shm"]), "now")
    assert "--memory-dir /dev/shm`" in text
    assert "**cost 15.0%**" in text
    assert "900 (0.900), 800 (0.800), 850 (0.850)" in text
    assert "audit-off 100, audited 150.5; audit-off 101, audited 160" in text


def test_openbao_gets_the_cost_of_its_own_audit_device_from_the_same_rounds() -> None:
    """``--openbao``: OpenBao audited against OpenBao without, beside cryptd's figures."""
    report = Report("pinned", "fast", openbao=True)
    report.rounds = [
        Round(1000, 700, openbao_off_ops=400, openbao_audited_ops=200),
        Round(1000, 700, openbao_off_ops=500, openbao_audited_ops=300),
        Round(1000, 700, openbao_off_ops=400, openbao_audited_ops=240),
    ]
    assert report.openbao_cost == pytest.approx(0.40)  # ratios 0.5, 0.6, 0.6
    assert report.summary()["openbao_cost"] == pytest.approx(0.40)
    assert Report("pinned", "fast", rounds=report.rounds).openbao_cost is None
    text = markdown(report, parse_args(["--openbao"]), "now")
    assert " --openbao`" in text
    assert "OpenBao with its file audit device against OpenBao without" in text
    assert "**cost 40.0%**; per round req/s per core: 200 (0.500), 300 (0.600), 240 (0.600)" in text


def test_options_are_checked() -> None:
    assert parse_args([]).rounds == 6
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


@pytest.mark.slow
def test_a_tiny_run_end_to_end(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed (apt-get install -y wrk)")
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "loadtest.audit_cost", "--rounds", "1", "--duration", "1"]
    command += ["--connections", "2", "--out", str(out), "--openbao"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: goal missed on a busy machine
    report = orjson.loads(out.read_bytes())
    assert len(report["rounds"]) == 1
    assert report["rounds"][0]["off_ops"] > 0
    assert report["rounds"][0]["audited_ops"] > 0
    assert report["verify_exit"] == 0, report["verify_output"]
    assert report["records"] >= report["audited_requests"] > 0
    # OpenBao without and with its audit device, driven in the same round through Transit.
    assert report["rounds"][0]["openbao_off_ops"] > 0
    assert report["rounds"][0]["openbao_audited_ops"] > 0
    assert report["openbao_cost"] < 1


def test_audit_groups_reads_group_sizes_from_perf_script() -> None:
    """``loadtest.audit_groups``: the audit file's writes (the descriptor most written with
    records) counted as records per group, the other descriptors' writes ignored."""
    write = "python 11 [001] 1.0: syscalls:sys_enter_write: fd: {}, buf: 0x1, count: {}"
    sync = "python 12 [001] 1.4: syscalls:sys_enter_fdatasync: fd: 0x00000003"
    script = "\n".join(
        [
            # the worker: two groups of one record, one of three, and a socket write
            write.format("0x0000000c", "0x0000012c"),
            write.format("0x00000018", "0x00000040"),
            write.format("0x0000000c", "0x00000130"),
            write.format("0x0000000c", "0x00000384"),
            sync,
            sync,
        ]
    )
    assert audit_groups.group_sizes(script, 300) == ({1: 2, 3: 1}, 2)
    assert audit_groups.group_sizes("", 300) == ({}, 0)
