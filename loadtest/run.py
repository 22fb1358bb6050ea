"""cryptd against OpenBao Transit on this machine: same scenarios, same concurrency, alternating.

    python -m loadtest.run            # 10 s per measurement, 3 rounds: ~15 min on a quiet
                                      # machine, more while it waits for busy neighbours
    python -m loadtest.run --quick    # smoke run (~2 min)

Starts OpenBao (``bao server -dev``, Transit, keys aes256-gcm96 / rsa-2048 / ecdsa-p256 /
ed25519) and cryptd (``cryptd serve --dev`` in a private directory, request signing and metrics
on), picks cryptd's server worker count by measuring 1 and 2 (``--workers auto``), then runs
every scenario with wrk against both targets in turn, round after round (cryptd first in odd
rounds, OpenBao first in even ones), and the open-loop case study (RSA-2048 decrypt at a fixed
offered rate, on a cryptd sized for it: one worker unless --case-workers says otherwise).
Every cryptd request is signed by the load generator (Lua in wrk, Python in the open loop);
OpenBao requests carry ``X-Vault-Token``. Prints Markdown tables of the medians and
writes everything (every run) as JSON to ``loadtest/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import orjson

from loadtest import overhead
from loadtest.measure import Measurement, WrkStream, find_wrk, run_wrk, run_wrk_streams
from loadtest.openloop import http_request, run_open_loop
from loadtest.probe import RoundTrip, get_request, keepalive_round_trip
from loadtest.procstat import wait_for_quiet
from loadtest.report import (
    CaseStudy,
    Ceiling,
    Comparison,
    MixResult,
    capacity_table,
    comparison_table,
    summarize,
)
from loadtest.scenarios import BY_NAME, CASE_STUDY, MIX_BY_NAME, SCENARIOS, Mix, Scenario
from loadtest.targets import (
    Bare,
    Cryptd,
    OpenBao,
    PrivateRedis,
    Target,
    check_response,
    find_bao,
    prepare_body,
)
from service.auth.signature import sign_request

RESULTS_DIR: Final = Path(__file__).resolve().parent / "results"
DEFAULT_REDIS: Final = "redis://127.0.0.1:6379/0"
CALIBRATION_DEFAULT: Final = tuple(s.name for s in SCENARIOS if s.openbao is not None)
CALIBRATION_QUICK: Final = ("aes-encrypt", "rsa-sign")
# Two worker processes must beat one by this much to be worth the extra memory and processes.
WORKERS_MARGIN: Final = 1.03


@dataclass(frozen=True)
class Topology:
    """Where the load generators and the servers run. Pinned (the default with two CPUs or
    more): the runner, wrk and the open-loop generator on ``client``, every server (cryptd and
    its Redis, OpenBao, the bare-ASGI ceiling) on ``server``, OpenBao with GOMAXPROCS equal to
    their number. Shared: everything anywhere (``--shared-cores``)."""

    pinned: bool
    client: frozenset[int]
    server: frozenset[int]

    @property
    def server_cpus(self) -> frozenset[int] | None:
        return self.server if self.pinned else None

    @property
    def server_cores(self) -> int:
        """The cores the servers may use: what ops per server core divides by."""
        return len(self.server)

    def summary(self) -> str:
        if not self.pinned:
            return f"shared cores: servers and load generators on the same {len(self.server)}"
        return (
            f"pinned: load generators on CPU {_cpu_list(self.client)}, "
            f"servers on CPU {_cpu_list(self.server)}"
        )


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _parse_cpus(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def make_topology(args: argparse.Namespace) -> Topology:
    available = sorted(os.sched_getaffinity(0))
    if args.shared_cores or len(available) < 2:
        every = frozenset(available)
        return Topology(False, every, every)
    if args.server_cpus:
        server = _parse_cpus(args.server_cpus)
    else:
        # Half the CPUs each (the load generator gets the first ones): 1 + 1 on two.
        server = frozenset(available[len(available) // 2 :])
    client = _parse_cpus(args.client_cpus) if args.client_cpus else frozenset(available) - server
    if not client or not server or client & server:
        raise SystemExit("--client-cpus and --server-cpus must be disjoint and non-empty")
    if not (client | server) <= set(available):
        raise SystemExit(
            f"CPUs outside this process's affinity ({_cpu_list(frozenset(available))})"
        )
    return Topology(True, client, server)


@dataclass(frozen=True)
class Plan:
    duration: float
    rounds: int
    warmup: float
    connections: int
    threads: int
    case_rate: float
    case_duration: float
    calibration: float
    calibration_scenarios: tuple[str, ...]
    scenarios: tuple[str, ...]
    quiet_threshold: float = 0.0  # wait for the rest of the machine to use <= this many cores
    quiet_wait: float = 0.0  # ... for at most this many seconds (0: never wait)
    # wrk computes each cryptd body's Content-Digest once per thread (the body never changes;
    # nonce, created and HMAC stay per request); False: pure-Lua SHA-256 on every request.
    digest_once: bool = True
    topology: Topology = Topology(False, frozenset({0}), frozenset({0}))
    ceiling: bool = True  # measure the bare-ASGI ceiling beside aes-encrypt
    mixes: tuple[str, ...] = ()


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    if args.scenarios == "none":  # the case study alone
        chosen: tuple[str, ...] = ()
    else:
        chosen = tuple(args.scenarios.split(",")) if args.scenarios else (*BY_NAME, *MIX_BY_NAME)
    unknown = [s for s in chosen if s not in BY_NAME and s not in MIX_BY_NAME]
    if unknown:
        known = ", ".join([*BY_NAME, *MIX_BY_NAME])
        raise SystemExit(f"unknown scenarios: {', '.join(unknown)} (known: {known})")
    scenarios = tuple(s for s in chosen if s in BY_NAME)
    mixes = tuple(s for s in chosen if s in MIX_BY_NAME)
    return Plan(
        duration=args.duration or (3.0 if quick else 10.0),
        rounds=args.rounds or (1 if quick else 3),
        warmup=1.0 if quick else 2.0,
        connections=args.connections,
        threads=args.threads,
        case_rate=args.case_rate,
        case_duration=args.case_duration or (5.0 if quick else 20.0),
        calibration=2.0 if quick else 3.0,
        calibration_scenarios=CALIBRATION_QUICK if quick else CALIBRATION_DEFAULT,
        scenarios=scenarios,
        quiet_threshold=args.quiet,
        quiet_wait=args.quiet_wait if args.quiet > 0 else 0.0,
        digest_once=not args.digest_every_request,
        topology=make_topology(args),
        ceiling=not args.no_ceiling,
        mixes=mixes,
    )


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Bodies and one measurement


@dataclass
class Prepared:
    """Body files per (target, scenario), checked with one request each."""

    directory: Path
    files: dict[tuple[str, str], Path]

    def body(self, target: str, scenario: str) -> bytes:
        return self.files[(target, scenario)].read_bytes()


def prepare(targets: Sequence[Target], scenarios: Sequence[Scenario], directory: Path) -> Prepared:
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[tuple[str, str], Path] = {}
    for target in targets:
        for scenario in scenarios:
            endpoint = scenario.cryptd if target.name == "cryptd" else scenario.openbao
            if endpoint is None:
                continue
            body = prepare_body(target, endpoint)
            status, data = target.request(endpoint.path, body)
            check_response(status, data, scenario.items)
            path = directory / f"{target.name}-{scenario.name}.json"
            path.write_bytes(orjson.dumps(body))
            files[(target.name, scenario.name)] = path
    return Prepared(directory, files)


def settle(plan: Plan) -> float | None:
    """Before a measured run: wait for the shared cores to calm down (see --quiet)."""
    if plan.quiet_wait <= 0:
        return None
    return wait_for_quiet(
        plan.quiet_threshold,
        plan.quiet_wait,
        lambda load: log(f"  waiting for a quiet machine (others use {load:.2f} cores)"),
    )


NOISY_RETRIES: Final = 2


def quietly(plan: Plan, run: Callable[[], Measurement]) -> Measurement:
    """Wait for a quiet machine, measure; if other processes still took more than
    ``plan.quiet_threshold`` cores during the run, measure again (twice at most) and keep the
    least disturbed run. Disabled with --quiet 0."""
    best: Measurement | None = None
    for attempt in range(NOISY_RETRIES + 1):
        settle(plan)
        m = run()
        if best is None or _others(m) < _others(best):
            best = m
        if plan.quiet_wait <= 0 or _others(m) <= plan.quiet_threshold:
            break
        if attempt < NOISY_RETRIES:
            log(f"  others took {_others(m):.2f} cores during the run: measuring again")
    assert best is not None
    return best


def _others(m: Measurement) -> float:
    return (m.others_cpu_s or 0.0) / m.seconds if m.seconds else 0.0


AnyTarget = Cryptd | OpenBao | Bare


def stream(
    target: AnyTarget,
    scenario: Scenario,
    prepared: Prepared,
    plan: Plan,
    connections: int | None = None,
    signer: Cryptd | None = None,
) -> WrkStream:
    """The wrk process that drives ``scenario`` against ``target``. The bare-ASGI ceiling
    gets cryptd's requests, signed the same way (``signer``'s credentials), which it ignores."""
    if isinstance(target, OpenBao):
        script, env = "openbao.lua", {"BAO_TOKEN": target.token}
        body = prepared.files[(target.name, scenario.name)]
    else:
        credentials = target if isinstance(target, Cryptd) else signer
        if credentials is None:
            raise ValueError("the bare target needs a cryptd signer's credentials")
        script, env = "cryptd.lua", {"CRYPTD_CREDENTIALS": str(credentials.credentials)}
        if plan.digest_once:
            env["CRYPTD_LT_DIGEST"] = "once"
        # A cryptd target has its own bodies (its keys); the bare ceiling takes cryptd's.
        owner = target.name if isinstance(target, Cryptd) else "cryptd"
        body = prepared.files[(owner, scenario.name)]
    return WrkStream(
        script,
        target.url,
        [scenario.name, str(body)],
        connections or plan.connections,
        plan.threads,
        env,
        scenario.items,
    )


def measure(
    target: AnyTarget,
    scenario: Scenario,
    prepared: Prepared,
    plan: Plan,
    duration: float,
    connections: int | None = None,
    signer: Cryptd | None = None,
) -> Measurement:
    one = stream(target, scenario, prepared, plan, connections, signer)
    return run_wrk(
        one.script,
        one.url,
        one.args,
        connections=one.connections,
        threads=one.threads,
        duration=duration,
        env=one.env,
        server_pid=target.pids,
        items=one.items,
    )


def measure_mix(
    target: Cryptd | OpenBao, mix: Mix, prepared: Prepared, plan: Plan, duration: float
) -> dict[str, Measurement]:
    """Every stream of ``mix`` at once against ``target``; figures per stream."""
    streams = [
        stream(target, BY_NAME[name], prepared, plan, connections)
        for name, connections in mix.streams
    ]
    found = run_wrk_streams(streams, duration=duration, server_pid=target.pids)
    return {name: m for (name, _), m in zip(mix.streams, found, strict=True)}


def describe(m: Measurement) -> str:
    return (
        f"{m.ops:,.0f} ops/s  P50 {m.p50_ms:.2f} ms  P99 {m.p99_ms:.2f} ms  errors {m.errors}"
        + (f"  others' CPU {m.others_cpu_s / m.seconds:.2f} cores" if m.others_cpu_s else "")
    )


# --------------------------------------------------------------------------------------------
# Server worker count, keep-alive probe


def redis_url(choice: str) -> str | None:
    if choice == "none":
        return None
    url = DEFAULT_REDIS if choice == "auto" else choice
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception as exc:
        if choice != "auto":
            raise SystemExit(f"Redis at {url} is not reachable: {exc}") from exc
        return None
    return url


def cryptd_env(workers: int, redis: str | None) -> dict[str, str]:
    # Several workers share the host's replay store unless the run names a Redis (the store
    # replicas share); one worker never needs it.
    return {"CRYPTD_REDIS_URL": redis} if workers > 1 and redis else {}


def probe(cryptd: Cryptd) -> dict[str, Any]:
    """Idle keep-alive round trips: an unsigned GET and a signed encrypt."""
    host = cryptd.url.removeprefix("http://")
    body = orjson.dumps(BY_NAME["aes-encrypt"].cryptd.body(None))
    path = BY_NAME["aes-encrypt"].cryptd.path

    def signed() -> bytes:
        headers = sign_request("POST", path, "", body, cryptd.client_id, cryptd.secret)
        return http_request(host, path, headers, body)

    results: list[RoundTrip] = [
        keepalive_round_trip(cryptd.url, "/healthz", lambda: get_request(host, "/healthz")),
        keepalive_round_trip(cryptd.url, path, signed),
    ]
    return {
        r.path: {"median_ms": r.median_ms, "max_ms": r.max_ms, "trapped": r.trapped}
        for r in results
    }


def calibrate_workers(
    workdir: Path, plan: Plan, redis: str | None, prepared_dir: Path
) -> tuple[int, dict[str, Any]]:
    """Measure 1 and 2 server workers side by side (both servers up, measured in turn on each
    calibration scenario, so both see the same machine); keep the faster."""
    scenarios = [BY_NAME[name] for name in plan.calibration_scenarios]
    cpus = plan.topology.server_cpus
    servers = {w: Cryptd(workdir, w, cryptd_env(w, redis), cpus) for w in (1, 2)}
    figures: dict[str, dict[str, Any]] = {str(w): {"ops": {}} for w in servers}
    try:
        for server in servers.values():
            server.start()
        for workers, server in servers.items():
            figures[str(workers)]["probe"] = probe(server)
        prepared = {
            w: prepare([server], scenarios, prepared_dir / f"calibration-{w}")
            for w, server in servers.items()
        }
        for index, scenario in enumerate(scenarios):
            order = (1, 2) if index % 2 == 0 else (2, 1)
            for workers in order:
                server = servers[workers]
                measure(server, scenario, prepared[workers], plan, 1.0)  # warm-up
                m = quietly(
                    plan,
                    partial(measure, server, scenario, prepared[workers], plan, plan.calibration),
                )
                figures[str(workers)]["ops"][scenario.name] = m.ops
                log(f"  workers={workers} {scenario.name}: {describe(m)}")
    finally:
        for server in servers.values():
            server.stop()
    ratios = [figures["2"]["ops"][s.name] / figures["1"]["ops"][s.name] for s in scenarios]
    gain = math.exp(statistics.fmean(math.log(r) for r in ratios))
    chosen = 2 if gain >= WORKERS_MARGIN else 1
    return chosen, {"figures": figures, "gain_2_over_1": gain, "chosen": chosen}


# --------------------------------------------------------------------------------------------
# Side metrics: metrics on/off


def metrics_cost(
    workdir: Path, workers: int, redis: str | None, plan: Plan, prepared_dir: Path
) -> dict[str, Any]:
    """aes-encrypt against two cryptd servers, CRYPTD_METRICS on and off, alternating."""
    scenario = BY_NAME["aes-encrypt"]
    servers = {
        flag: Cryptd(
            workdir,
            workers,
            {**cryptd_env(workers, redis), "CRYPTD_METRICS": flag},
            plan.topology.server_cpus,
        )
        for flag in ("true", "false")
    }
    runs: dict[str, list[Measurement]] = {"true": [], "false": []}
    try:
        for server in servers.values():
            server.start()
        metrics_exposed = servers["true"].get("/metrics").status_code == 200
        prepared = {
            flag: prepare([server], [scenario], prepared_dir / f"metrics-{flag}")
            for flag, server in servers.items()
        }
        for flag, server in servers.items():
            measure(server, scenario, prepared[flag], plan, 1.0)
        for round_no in range(max(plan.rounds, 2)):
            order = ("true", "false") if round_no % 2 == 0 else ("false", "true")
            for flag in order:
                m = quietly(
                    plan,
                    partial(measure, servers[flag], scenario, prepared[flag], plan, plan.duration),
                )
                runs[flag].append(m)
                log(f"  metrics={flag}: {describe(m)}")
    finally:
        for server in servers.values():
            server.stop()
    on, off = summarize(runs["true"], _cores()), summarize(runs["false"], _cores())
    return {
        "metrics_endpoint": metrics_exposed,
        "on": on.to_json(),
        "off": off.to_json(),
        "throughput_cost": 1 - on.ops / off.ops if off.ops else None,
    }


# --------------------------------------------------------------------------------------------
# Main flow


def _cores() -> int:
    return os.cpu_count() or 1


def _version(command: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
        text = (done.stdout or done.stderr).strip().splitlines()
        return text[0] if text else ""
    return ""


def interpreter() -> str:
    """The CPython that runs cryptd and the bare app (the targets start ``sys.executable``): its
    version and base executable, outside any venv. How it was built moves every figure: the
    image's CPython is built with PGO and LTO; on a pyenv build with neither cryptd spends 11-20 %
    more CPU a request (docs/PERFORMANCE.md, "The interpreter")."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    return f"{platform.python_implementation()} {platform.python_version()} ({base})"


def interpreter_of(machine: dict[str, Any]) -> str:
    """The interpreter a result records; a run from before it was recorded gives its version."""
    found: str | None = machine.get("interpreter")
    return found or f"Python {machine['python']}"


def served_by(machine: dict[str, Any]) -> str:
    """The README line's "cryptd and the bare app on ...; ", empty for a run without it."""
    found = machine.get("interpreter")
    return f"cryptd and the bare app on {found}; " if found else ""


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from service import __version__

    return {
        "cpu": model,
        "cores": _cores(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "interpreter": interpreter(),
        "wrk": _version([find_wrk() or "wrk", "-v"]),
        "openbao": _version([find_bao(), "version"]),
        "cryptd": __version__,
        "git_head": _version(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]
        ),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


CEILING_SCENARIO: Final = "aes-encrypt"  # the bare-ASGI ceiling is measured beside it


def run_rounds(
    cryptd: Cryptd,
    bao: OpenBao | None,
    prepared: Prepared,
    plan: Plan,
    bare: Bare | None = None,
) -> dict[str, dict[str, list[Measurement]]]:
    """Every scenario against every target, alternating the order round by round. With
    ``bare``, the ceiling is a third target of the ceiling scenario."""
    runs: dict[str, dict[str, list[Measurement]]] = {
        name: {"cryptd": [], "openbao": [], "bare": []} for name in plan.scenarios
    }
    targets: list[AnyTarget] = [cryptd, *([bao] if bao else [])]

    def targets_of(name: str) -> list[AnyTarget]:
        chosen = [t for t in targets if (t.name, name) in prepared.files]
        if bare is not None and name == CEILING_SCENARIO:
            chosen.append(bare)
        return chosen

    log("warm-up")
    for name in plan.scenarios:
        for target in targets_of(name):
            measure(target, BY_NAME[name], prepared, plan, plan.warmup, signer=cryptd)
    for round_no in range(plan.rounds):
        for name in plan.scenarios:
            chosen = targets_of(name)
            for target in chosen if round_no % 2 == 0 else chosen[::-1]:
                m = quietly(
                    plan,
                    partial(
                        measure, target, BY_NAME[name], prepared, plan, plan.duration, signer=cryptd
                    ),
                )
                runs[name][target.name].append(m)
                log(f"round {round_no + 1}/{plan.rounds} {name} {target.name}: {describe(m)}")
    return runs


def run_mixes(
    cryptd: Cryptd, bao: OpenBao | None, prepared: Prepared, plan: Plan
) -> list[MixResult]:
    """Each mix against each target, its streams at once, and its ``alone`` stream by itself
    at the same connection count; alternating the targets round by round."""
    results = []
    targets: list[Cryptd | OpenBao] = [cryptd] + ([bao] if bao else [])
    for name in plan.mixes:
        mix = MIX_BY_NAME[name]
        alone = BY_NAME[mix.alone]
        alone_connections = dict(mix.streams)[mix.alone]
        mixed: dict[str, list[dict[str, Measurement]]] = {t.name: [] for t in targets}
        by_itself: dict[str, list[Measurement]] = {t.name: [] for t in targets}
        for target in targets:
            measure_mix(target, mix, prepared, plan, plan.warmup)
        for round_no in range(plan.rounds):
            for target in targets if round_no % 2 == 0 else targets[::-1]:
                streams = quietly_mix(plan, target, mix, prepared)
                mixed[target.name].append(streams)
                m = quietly(
                    plan,
                    partial(
                        measure, target, alone, prepared, plan, plan.duration, alone_connections
                    ),
                )
                by_itself[target.name].append(m)
                log(
                    f"round {round_no + 1}/{plan.rounds} {name} {target.name}: "
                    + "; ".join(f"{s} {describe(ms)}" for s, ms in streams.items())
                    + f"; {mix.alone} alone {describe(m)}"
                )
        results.append(MixResult(mix, mixed, by_itself, plan.topology.server_cores))
    return results


def quietly_mix(
    plan: Plan, target: Cryptd | OpenBao, mix: Mix, prepared: Prepared
) -> dict[str, Measurement]:
    """:func:`quietly` for a mix: the first stream's figures judge the window."""
    found: dict[str, Measurement] = {}

    def run() -> Measurement:
        found.clear()
        found.update(measure_mix(target, mix, prepared, plan, plan.duration))
        return next(iter(found.values()))

    quietly(plan, run)
    return dict(found)


def run_case_study(
    cryptd: Cryptd, bao: OpenBao | None, prepared: Prepared, plan: Plan
) -> CaseStudy:
    endpoint = CASE_STUDY.cryptd
    cryptd_body = prepared.body("cryptd", CASE_STUDY.name)
    host = cryptd.url.removeprefix("http://")

    def cryptd_request() -> bytes:
        # Signed at send time: a fresh created and nonce per request, like a real client.
        headers = sign_request(
            "POST", endpoint.path, "", cryptd_body, cryptd.client_id, cryptd.secret
        )
        return http_request(host, endpoint.path, headers, cryptd_body)

    factories: list[tuple[Cryptd | OpenBao, Callable[[], bytes]]] = [(cryptd, cryptd_request)]
    if bao is not None and CASE_STUDY.openbao is not None:
        bao_request = http_request(
            bao.url.removeprefix("http://"),
            CASE_STUDY.openbao.path,
            {"X-Vault-Token": bao.token, "Content-Type": "application/json"},
            prepared.body("openbao", CASE_STUDY.name),
        )
        factories.append((bao, lambda: bao_request))
    results: dict[str, list[Measurement]] = {"cryptd": [], "openbao": []}
    for target, factory in factories:  # warm-up at the same rate
        run_open_loop(target.url, factory, rate=plan.case_rate, duration=min(2.0, plan.warmup))
    for round_no in range(plan.rounds):
        order = factories if round_no % 2 == 0 else factories[::-1]
        for target, factory in order:
            m = quietly(
                plan,
                partial(
                    run_open_loop,
                    target.url,
                    factory,
                    rate=plan.case_rate,
                    duration=plan.case_duration,
                    server_pid=target.pids,
                ),
            )
            results[target.name].append(m)
            log(
                f"case study round {round_no + 1}/{plan.rounds} {target.name}: "
                f"{m.rps:,.0f} req/s of {plan.case_rate:,.0f} offered, P50 {m.p50_ms:.2f} ms "
                f"P99 {m.p99_ms:.2f} ms errors {m.errors} "
                f"(generator lag P99 {m.detail['send_lag_p99_ms']:.2f} ms)"
            )
    return CaseStudy(plan.case_rate, plan.case_duration, results["cryptd"], results["openbao"])


def render(
    result: dict[str, Any],
    comparisons: list[Comparison],
    case: CaseStudy | None,
    ceiling: Ceiling | None = None,
    mixes: Sequence[MixResult] = (),
) -> str:
    m, cfg = result["machine"], result["config"]
    cores = cfg.get("server_cores", 1)
    out = [
        f"# cryptd vs OpenBao Transit ({result['started']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, "
        f"{interpreter_of(m)}, "
        f"{m['openbao']}, {m['wrk']}. Load average at start: {' '.join(m['loadavg'])}"
        + (f", at end: {' '.join(m['loadavg_end'])}" if m.get("loadavg_end") else "")
        + ".",
        f"Topology: {cfg['topology']}. Command: `{cfg['command']}`.",
        f"Load: wrk -t{cfg['threads']} -c{cfg['connections']}, {cfg['duration']:.0f} s per "
        f"measurement, {cfg['rounds']} round(s), medians; cryptd with {cfg['workers']} server "
        f"worker(s){' and a Redis replay store' if cfg['redis'] else ''}, signing, metrics and "
        "the audit log on; "
        + (
            "wrk hashes each body once per thread (fresh nonce, created and HMAC per request)."
            if cfg.get("digest_once", True)
            else "wrk hashes every body anew (pure Lua)."
        ),
        "",
        comparison_table(comparisons, cores),
        "",
        "Goals: ops/s per server core >= 1.5x OpenBao's (batch in items/s), P99 <= 1/2 of "
        "OpenBao's, no errors.",
    ]
    if ceiling is not None:
        out += ["", "## The bare-ASGI ceiling on the same CPUs", "", ceiling.table()]
    for mix in mixes:
        out += ["", f"## Mixed traffic: {mix.mix.title}", "", mix.table()]
    out += ["", "## Capacity (server CPU per operation)", "", capacity_table(comparisons)]
    if case is not None:
        out += [
            "",
            f"## Case study: RSA-2048 decrypt, {case.rate:,.0f} req/s offered (open loop), "
            f"{case.duration:.0f} s x {cfg['rounds']}, cryptd with "
            f"{cfg.get('case_workers', cfg['workers'])} worker(s)",
            "",
            case.table(),
        ]
    probe_data = result.get("probe")
    if probe_data:
        out += ["", "## Idle keep-alive round trip (TCP_NODELAY check)", ""]
        for path, figures in probe_data.items():
            out.append(
                f"- {path}: median {figures['median_ms']:.3f} ms, max {figures['max_ms']:.3f} ms"
                + (" - DELAYED-ACK TRAP" if figures["trapped"] else "")
            )
    auth = result.get("auth_cost")
    if auth:
        out += ["", "## Request authentication cost (in-process)", ""]
        out.append("| scenario | verify+replay us | middleware us | share of server CPU/request |")
        out.append("|---|---:|---:|---:|")
        for row in auth:
            share = row.get("share_of_request")
            out.append(
                f"| {row['scenario']} | {row['verify_replay_us']:.1f} | {row['middleware_us']:.1f} "
                f"| {'-' if share is None else f'{share:.0%}'} |"
            )
    metrics = result.get("metrics_cost")
    if metrics:
        cost = metrics["throughput_cost"]
        out += [
            "",
            f"Metrics on vs off (aes-encrypt): {metrics['on']['ops']:,.0f} vs "
            f"{metrics['off']['ops']:,.0f} ops/s"
            + ("" if cost is None else f" ({cost:+.1%} cost)")
            + ("" if metrics["metrics_endpoint"] else " - /metrics is not served (not wired)"),
        ]
    return "\n".join(out)


# Markers around the generated part of README.md's performance section.
README_BEGIN: Final = "<!-- loadtest.run: begin -->"
README_END: Final = "<!-- loadtest.run: end -->"


def readme_table(
    result: dict[str, Any],
    comparisons: list[Comparison],
    case: CaseStudy | None,
    ceiling: Ceiling | None,
    mixes: Sequence[MixResult],
) -> str:
    """The README's table: the main comparison, the ceiling and the mix, in a few lines."""
    cfg = result["config"]
    shares = [c.cryptd.others_cpu_share for c in comparisons if c.cryptd.others_cpu_share]
    others = (
        f"; other processes used {statistics.median(shares) * result['machine']['cores']:.2f}"
        " cores during the measurements"
        if shares
        else ""
    )
    lines = [
        f"Run of {result['started']} on `{result['machine']['git_head']}` ({cfg['topology']}; "
        f"{served_by(result['machine'])}load average {' '.join(result['machine']['loadavg'])} at "
        f"start{others}), reproduced by `{cfg['command']}`:",
        "",
        comparison_table(comparisons, cfg.get("server_cores", 1)),
    ]
    if case is not None:
        ours, theirs = case.medians(case.cryptd), case.medians(case.openbao)
        lines += [
            "",
            f"Case study, RSA-2048 decrypt at {case.rate:,.0f} req/s offered (open loop): P99 "
            f"{_fmt_ms(ours['p99_ms'])} against OpenBao's {_fmt_ms(theirs['p99_ms'])}.",
        ]
    if ceiling is not None and ceiling.share is not None:
        lines += [
            "",
            f"Bare-ASGI ceiling on the same core: {ceiling.bare.rps:,.0f} req/s; cryptd's AES-GCM "
            f"encrypt's share of it: {ceiling.verdict()}, with {ceiling.own_us or 0:.0f} us of "
            "its own work per request.",
        ]
    for mix in mixes:
        lines += ["", f"{mix.mix.title}:", "", mix.table()]
    return "\n".join(lines)


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def update_readme(path: Path, table: str) -> None:
    replace_section(path, README_BEGIN, README_END, table)


def replace_section(path: Path, begin: str, end_marker: str, text: str) -> None:
    """Put ``text`` between the ``begin`` and ``end_marker`` lines of ``path``."""
    content = path.read_text()
    start, end = content.find(begin), content.find(end_marker)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no {begin} ... {end_marker} section")
    path.write_text(content[: start + len(begin)] + "\n" + text + "\n" + content[end:])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--duration", type=float, help="seconds per measurement (10; quick 3)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (3; quick 1)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (1)")
    topology = parser.add_argument_group("topology")
    topology.add_argument(
        "--shared-cores",
        action="store_true",
        help="servers and load generators on the same cores (default with two CPUs or more:"
        " pinned, load generators on the first half of the CPUs, servers on the rest)",
    )
    topology.add_argument("--client-cpus", help="CPUs of the load generators, e.g. 0 or 0-1")
    topology.add_argument("--server-cpus", help="CPUs of every server, e.g. 1 or 2-3")
    cryptd = parser.add_argument_group("cryptd")
    cryptd.add_argument(
        "--workers",
        default="auto",
        help="cryptd server workers: a number, or auto (pinned: one per server CPU, 1 and 2"
        " measured when there are two or more; shared cores: 1 and 2 measured)",
    )
    cryptd.add_argument(
        "--redis",
        default="host",
        help="replay store for several workers: host (cryptd's default: the host's workers"
        " share an LMDB file), private (a redis-server of the run's own, pinned with the"
        " servers), or a Redis URL",
    )
    cryptd.add_argument(
        "--cryptd-env",
        type=env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for every cryptd server (repeatable), e.g."
        ' CRYPTD_EXECUTORS=\'{"rsa-2048":"thread"}\'',
    )
    parser.add_argument(
        "--scenarios",
        help="comma-separated subset of the scenarios and mixes (default: all; none: the case"
        " study alone)",
    )
    parser.add_argument("--no-ceiling", action="store_true", help="skip the bare-ASGI ceiling")
    parser.add_argument("--case-rate", type=float, default=500.0, help="offered req/s (500)")
    parser.add_argument("--case-duration", type=float, help="case-study seconds (20; quick 5)")
    parser.add_argument(
        "--case-workers",
        default="1",
        help="cryptd server workers for the case study: a number or 'same' (1: at 500 req/s"
        " one worker has the lower latency, no Redis round trip; docs/PERFORMANCE.md)",
    )
    parser.add_argument("--no-case-study", action="store_true")
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        help="before each measurement wait until other processes use at most this many cores"
        " (0.25; 0 = never wait)",
    )
    parser.add_argument(
        "--digest-every-request",
        action="store_true",
        help="wrk hashes every cryptd body anew in pure Lua (~100 MB/s: 1.6 ms of the shared"
        " cores per 140 KB batch). By default each unchanging body is hashed once per wrk"
        " thread; every request still gets a fresh nonce, created and HMAC",
    )
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="longest wait, s (120)")
    parser.add_argument("--no-openbao", action="store_true", help="cryptd only")
    parser.add_argument("--metrics-cost", action="store_true", help="also measure metrics off")
    parser.add_argument("--json", type=Path, help="JSON output (default loadtest/results/...)")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument(
        "--update-readme",
        type=Path,
        nargs="?",
        const=Path(__file__).resolve().parent.parent / "README.md",
        help="rewrite the generated table of README.md's performance section (or of FILE)",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        metavar="FILE.png",
        help="also draw cryptd against OpenBao per scenario, throughput and P99 (charts extra)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    return parser.parse_args(argv)


# Where a run writes its figures changes nothing it measures: left out of the command it reports.
_OUTPUT_OPTIONS: Final = ("--json", "--markdown", "--chart")


def reproduce_command(module: str, argv: Sequence[str]) -> str:
    """``python -m MODULE ARGS``: the command that measures the same again, without the
    options that only name output files."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _OUTPUT_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _OUTPUT_OPTIONS)):
            kept.append(arg)
    return " ".join(["python", "-m", module, *kept])


def env_pair(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (NAME, VALUE): one variable of a cryptd server's environment."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if find_wrk() is None:
        print("wrk is not installed: apt-get install -y wrk", file=sys.stderr)
        return 2
    topology = plan.topology
    if topology.pinned:
        # The runner, and so wrk and the open-loop generator (its children and itself), on the
        # load generators' CPUs; every server is started on the others.
        os.sched_setaffinity(0, topology.client)
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    workdir = Path(tempfile.mkdtemp(prefix="cryptd-loadtest-"))
    extra = dict(args.cryptd_env)
    result: dict[str, Any] = {"started": started, "machine": machine()}
    log(f"working directory {workdir}; {topology.summary()}")
    try:
        with contextlib.ExitStack() as stack:
            bao: OpenBao | None = None
            if not args.no_openbao:
                bao = OpenBao(workdir / "openbao", topology.server_cpus)
                stack.callback(bao.stop)
                bao.start()
                log(f"OpenBao at {bao.url}")

            redis: str | None = None
            if args.redis == "private":
                private = PrivateRedis(workdir / "redis", topology.server_cpus)
                with contextlib.suppress(RuntimeError):
                    private.start()
                    stack.callback(private.stop)
                    redis = private.url
            elif args.redis not in ("host", "none"):  # none: the earlier name of host
                redis = redis_url(args.redis)

            if args.workers == "auto" and (not topology.pinned or topology.server_cores > 1):
                log("choosing the server worker count (1 vs 2)")
                workers, calibration = calibrate_workers(
                    workdir / "cryptd", plan, redis, workdir / "bodies"
                )
                result["workers_calibration"] = calibration
                log(f"workers: {workers} (2 vs 1: {calibration['gain_2_over_1']:.2f}x)")
            else:
                workers = 1 if args.workers == "auto" else int(args.workers)
            env = {**cryptd_env(workers, redis), **extra}
            result["config"] = {
                **asdict(plan),
                "topology": topology.summary(),
                "server_cores": topology.server_cores,
                "command": reproduce_command(
                    "loadtest.run", sys.argv[1:] if argv is None else argv
                ),
                "workers": workers,
                "redis": env.get("CRYPTD_REDIS_URL"),
                "cryptd_env": extra,
            }

            cryptd = Cryptd(workdir / "cryptd", workers, env, topology.server_cpus)
            stack.callback(cryptd.stop)
            cryptd.start()
            log(f"cryptd at {cryptd.url} ({workers} worker(s))")
            result["probe"] = probe(cryptd)
            result["metrics_endpoint"] = cryptd.get("/metrics").status_code == 200

            needed = {*plan.scenarios}
            for name in plan.mixes:
                needed |= {stream_name for stream_name, _ in MIX_BY_NAME[name].streams}
            scenarios = [s for s in SCENARIOS if s.name in needed]
            targets: list[Target] = [cryptd] + ([bao] if bao else [])
            prepared = prepare(targets, scenarios, workdir / "bodies")

            bare: Bare | None = None
            if plan.ceiling and CEILING_SCENARIO in plan.scenarios:
                bare = Bare(workdir / "bare", topology.server_cpus)
                stack.callback(bare.stop)
                bare.start()
                log(f"bare-ASGI ceiling at {bare.url}")

            runs = run_rounds(cryptd, bao, prepared, plan, bare)
            cores = topology.server_cores
            comparisons = [
                Comparison(
                    name,
                    BY_NAME[name].title,
                    summarize(runs[name]["cryptd"], cores),
                    summarize(runs[name]["openbao"], cores) if runs[name]["openbao"] else None,
                )
                for name in plan.scenarios
            ]
            ceiling = None
            if bare is not None and runs[CEILING_SCENARIO]["bare"]:
                ceiling = Ceiling(
                    CEILING_SCENARIO,
                    summarize(runs[CEILING_SCENARIO]["cryptd"], cores),
                    summarize(runs[CEILING_SCENARIO]["bare"], cores),
                )
                bare.stop()
            mixes = run_mixes(cryptd, bao, prepared, plan)

            case = None
            if not args.no_case_study:
                case_workers = workers if args.case_workers == "same" else int(args.case_workers)
                case_cryptd = cryptd
                if case_workers != workers:
                    # Sized for the offered rate: its own server (same keys), up beside the
                    # other, which idles meanwhile.
                    case_cryptd = Cryptd(
                        workdir / "cryptd",
                        case_workers,
                        {**cryptd_env(case_workers, redis), **extra},
                        topology.server_cpus,
                    )
                    stack.callback(case_cryptd.stop)
                    case_cryptd.start()
                    log(f"case-study cryptd at {case_cryptd.url} ({case_workers} worker(s))")
                if (cryptd.name, CASE_STUDY.name) not in prepared.files:
                    prepared = prepare(targets, [CASE_STUDY], workdir / "bodies")
                case = run_case_study(case_cryptd, bao, prepared, plan)
                result["config"]["case_workers"] = case_workers

            auth_rows = []
            for name in ("aes-encrypt", "rsa-sign", "aes-batch"):
                cost = asdict(overhead.measure(name, count=2000, repeats=3))
                row = next((c for c in comparisons if c.scenario == name), None)
                per_request = row.cryptd.server_cpu_per_request_us if row else None
                cost["share_of_request"] = (
                    cost["middleware_us"] / per_request if per_request else None
                )
                auth_rows.append(cost)
            result["auth_cost"] = auth_rows

            result["runs"] = {
                name: {t: [m.to_json() for m in ms] for t, ms in by_target.items()}
                for name, by_target in runs.items()
            }
            result["comparisons"] = [c.to_json() for c in comparisons]
            result["ceiling"] = ceiling.to_json() if ceiling else None
            result["mixes"] = [mix.to_json() for mix in mixes]
            result["case_study"] = case.to_json() if case else None

            cryptd.stop()
            if bao is not None:
                bao.stop()
            if args.metrics_cost:
                log("metrics on/off")
                result["metrics_cost"] = metrics_cost(
                    workdir / "cryptd", workers, redis, plan, workdir / "bodies"
                )
        result["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        text = render(result, comparisons, case, ceiling, mixes)
        print(text)
        out = args.json or RESULTS_DIR / f"{started.replace(':', '')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        if args.markdown:
            args.markdown.write_text(text + "\n")
        if args.update_readme:
            update_readme(
                args.update_readme, readme_table(result, comparisons, case, ceiling, mixes)
            )
            log(f"updated {args.update_readme}")
        log(f"results: {out}")
        if args.chart:
            from loadtest.chart import comparison_chart

            log(f"chart: {comparison_chart(result, args.chart)}")
    finally:
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
