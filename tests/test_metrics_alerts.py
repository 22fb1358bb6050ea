"""The alert rules of k8s/monitoring pass Prometheus's own checks: ``promtool check rules``
on the PrometheusRule's groups, and ``promtool test rules`` (tests/promtool/alerts_test.yaml):
the certificate-expiry, store-availability, audit and clock-offset alerts fire when, and only
when, their series say so. promtool is Debian's ``prometheus`` package."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "k8s" / "monitoring" / "prometheusrule.yaml"
UNIT_TESTS = ROOT / "tests" / "promtool" / "alerts_test.yaml"

pytestmark = pytest.mark.slow  # runs an outside program


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not installed (Debian package prometheus)")
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return found


def _rule_file(directory: Path) -> Path:
    document = yaml.safe_load(RULES.read_text())
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": document["spec"]["groups"]}))
    return path


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_accepts_the_rules(promtool: str, tmp_path: Path) -> None:
    done = _run(promtool, "check", "rules", str(_rule_file(tmp_path)), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_new_alerts_fire_as_their_unit_tests_expect(promtool: str, tmp_path: Path) -> None:
    _rule_file(tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    done = _run(promtool, "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_tells_a_wrong_expectation(promtool: str, tmp_path: Path) -> None:
    _rule_file(tmp_path)
    broken = UNIT_TESTS.read_text().replace("pod: c", "pod: b", 1)
    assert broken != UNIT_TESTS.read_text()
    (tmp_path / UNIT_TESTS.name).write_text(broken)
    done = _run(promtool, "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
