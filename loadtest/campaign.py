"""The runner's measurements, each a whole sequence: the worker-count calibration, the rounds
of every scenario against every target (order alternating round by round), the mixes, the
open-loop case study, metrics on against off and the idle keep-alive probe."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

import orjson

from loadtest.machine import _cores
from loadtest.measure import Measurement
from loadtest.openloop import http_request, run_open_loop
from loadtest.plan import (
    Plan,
)
from loadtest.probe import RoundTrip, get_request, keepalive_round_trip
from loadtest.progress import describe, log
from loadtest.report import (
    CaseStudy,
    MixResult,
    summarize,
)
from loadtest.sampling import (
    AnyTarget,
    Prepared,
    measure,
    measure_mix,
    prepare,
    quietly,
    quietly_mix,
)
from loadtest.scenarios import BY_NAME, CASE_STUDY, MIX_BY_NAME
from loadtest.servers import cryptd_env
from loadtest.targets import (
    Bare,
    Cryptd,
    OpenBao,
)
from service.auth.signature import sign_request

# Two worker processes must beat one by this much to be worth the extra memory and processes.
WORKERS_MARGIN: Final = 1.03

CEILING_SCENARIO: Final = "aes-encrypt"  # the bare-ASGI ceiling is measured beside it


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
