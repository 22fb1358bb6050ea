"""Schemathesis against a live, signed development server: positive and negative data from
the committed document, every check (status codes, schemas, content types, headers, Allow,
auth): zero failures. Seed and examples per operation are fixed (tests/schemathesis.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest

from service.api import spec
from tests.conftest import Server, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A private server: the run creates, rotates and deletes keys. The loop-lag guard is
    # relaxed so a busy CI machine answers the fuzzer instead of shedding load (503). A
    # waiting period makes DELETE answer 202 with a pending key (and cancel-deletion 200).
    server = start_server(
        tmp_path_factory.mktemp("schemathesis"),
        {
            "CRYPTD_MAX_LOOP_LAG": "10",
            "CRYPTD_POOL_DEADLINE": "30",
            "CRYPTD_DELETION_WAITING_PERIOD": "60",
        },
    )
    yield server
    stop_server(server)


def test_schemathesis_finds_nothing(fuzzed_server: Server, tmp_path: Path) -> None:
    executable = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert executable is not None, "schemathesis is part of the test extra"
    env = {
        **os.environ,
        "CRYPTD_CREDENTIAL": str(fuzzed_server.directory / "dev" / "client.json"),
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [
            executable,
            "--config-file",
            str(ROOT / "tests" / "schemathesis.toml"),
            "run",
            # The committed document, served by the server under test.
            f"{fuzzed_server.url}/openapi.json",
            "--no-color",
            "--report",
            "junit",
            "--report-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20000:]
    # Zero failures and zero errors in the run's JUnit report, every operation in it. (A
    # warning, such as PATCH mostly answering 400 for versions a key does not have, is not a
    # failure: that 400 is the contract's.)
    (report,) = tmp_path.glob("junit*.xml")
    suites = ElementTree.parse(report).getroot()  # noqa: S314 - our own run's report
    cases = suites.findall(".//testcase")
    assert {case.get("name") for case in cases} >= {
        f"{route.method} {route.path}" for route in spec.ROUTES
    }
    assert not suites.findall(".//failure"), output[-5000:]
    assert not suites.findall(".//error"), output[-5000:]
    routes = len(spec.ROUTES)
    assert f"Selected: {routes}/{routes}" in output, output[-3000:]
    assert f"Tested: {routes}" in output, output[-3000:]
