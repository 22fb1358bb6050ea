"""One measurement against one target: the request bodies (checked with one request each),
the wrk stream that drives a scenario, and the retry that keeps the least disturbed run when the
rest of the machine was busy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from loadtest.measure import Measurement, WrkStream, run_wrk, run_wrk_streams
from loadtest.plan import (
    Plan,
)
from loadtest.procstat import wait_for_quiet
from loadtest.progress import log
from loadtest.scenarios import BY_NAME, Mix, Scenario
from loadtest.targets import (
    Bare,
    Cryptd,
    OpenBao,
    Target,
    check_response,
    prepare_body,
)

AnyTarget = Cryptd | OpenBao | Bare


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
        endpoint = scenario.openbao
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
        endpoint = scenario.cryptd
    if endpoint is None:
        raise ValueError(f"{scenario.name} has no {target.name} counterpart")
    return WrkStream(
        script,
        target.url,
        [scenario.name, str(body), endpoint.path],  # the path: scenarios the script lacks
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
