"""TLS on against off in one run: cryptd, the bare-ASGI ceiling and OpenBao, each plain and over
its own TLS, alternating, on the runner's pinned topology.

    python -m loadtest.tls              # 10 s x 3 rounds per target
    python -m loadtest.tls --record     # and keep the summary as docs/results/DATE-tls.md
    python -m loadtest.tls --quick      # smoke run
    python -m loadtest.tls --production --rounds 5 --record   # the README's table

``--production`` runs cryptd as production does beside the plain one: the replay store on a
Redis of the run's own (pinned with the servers, its CPU counted as cryptd's), the audit log to
a file with group fsync, failing closed, and metrics on; and OpenBao with its file audit device
(``--no-openbao-audit``: without, as its dev mode starts); the summary names the host's phase
(RSA-2048 PSS sign time in a bare loop, before and after) and gives every round's ratios.

Six servers run side by side on the server CPUs: cryptd plain and cryptd over TLS (``cryptd serve
--dev`` and ``--dev --tls``, each in its own directory; signing, metrics and the audit log on),
the bare-ASGI app plain and over TLS with cryptd's certificate and TLS context
(loadtest/bare.py), and OpenBao plain and with its own TLS (``bao server -dev -dev-tls``). wrk
drives them with keep-alive connections (a handshake per connection, then requests on it), as
clients talk to a service. Two questions, answered from the same run:

- the hot path: TLS must cost cryptd no more server CPU per request than it costs the bare app
  answering the same requests (AES-GCM encrypt 1 KiB, the ceiling scenario);
- against OpenBao: cryptd's throughput ratio with TLS on both sides is no worse than without.

Then the mixed traffic over TLS (``mix``, in the default scenarios): AES-GCM encrypt and RSA-2048
sign at once against cryptd over TLS and OpenBao over its TLS, and the cheap stream alone at the
same connection count (loadtest/campaign.py's ``run_mixes``, as ``loadtest.run`` measures it in
plain HTTP): the cheap stream's P99 beside the costly one must stay within twice its P99 alone.

Over 400 lines as one module: the run, its goals and its report read the same per-scenario
pairs (plain and TLS of each server); the round-by-round table lives in loadtest/tls_rounds.py.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from loadtest.campaign import CEILING_SCENARIO, run_mixes
from loadtest.machine import interpreter_of, served_by
from loadtest.measure import Measurement
from loadtest.options import (
    add_cryptd_env_option,
    add_load_options,
    add_output_options,
    add_quiet_options,
    add_topology_options,
)
from loadtest.phase import describe as describe_phase
from loadtest.phase import rsa_sign_us
from loadtest.plan import CALIBRATION_DEFAULT, Plan, load_settings
from loadtest.progress import describe, log
from loadtest.report import MixResult, Summary, summarize
from loadtest.sampling import AnyTarget, Prepared, measure, prepare, quietly
from loadtest.scenarios import BY_NAME, MIX_BY_NAME, SCENARIOS
from loadtest.session import session, write_outputs, wrk_missing
from loadtest.targets import Bare, Cryptd, OpenBao, PrivateRedis
from loadtest.tls_rounds import rounds_table

KINDS: Final = ("cryptd", "bare", "openbao")
LABELS: Final = {"cryptd": "cryptd", "bare": "bare ASGI", "openbao": "OpenBao"}


def label(kind: str, tls: bool) -> str:
    return f"{kind}-{'tls' if tls else 'plain'}"


@dataclass(frozen=True)
class Pair:
    """One server's figures on one scenario, plain and over TLS."""

    plain: Summary
    tls: Summary
    cores: int

    @property
    def tls_ratio(self) -> float | None:
        """Throughput over TLS as a fraction of plain."""
        return self.tls.ops / self.plain.ops if self.plain.ops else None

    @property
    def added_us(self) -> float | None:
        """Server CPU per request that TLS adds."""
        on, off = self.tls.server_cpu_per_request_us, self.plain.server_cpu_per_request_us
        return None if on is None or off is None else on - off

    def to_json(self) -> dict[str, Any]:
        return {
            "plain": self.plain.to_json(),
            "tls": self.tls.to_json(),
            "tls_ratio": self.tls_ratio,
            "added_us": self.added_us,
        }


@dataclass(frozen=True)
class ScenarioResult:
    scenario: str
    title: str
    pairs: Mapping[str, Pair]  # by kind; "bare" only on the ceiling scenario

    def ratio(self, tls: bool) -> float | None:
        """cryptd's throughput over OpenBao's, both plain or both over TLS."""
        cryptd, bao = self.pairs.get("cryptd"), self.pairs.get("openbao")
        if cryptd is None or bao is None:
            return None
        ours, theirs = (cryptd.tls, bao.tls) if tls else (cryptd.plain, bao.plain)
        return ours.ops / theirs.ops if theirs.ops else None

    def goals(self) -> dict[str, bool]:
        """``openbao``: the ratio with TLS on both sides is no worse than without; ``hot_path``
        (with the ceiling): TLS adds no more server CPU per request to cryptd than to the bare
        app; ``no_errors``: cryptd answered every request, plain and over TLS."""
        goals: dict[str, bool] = {}
        plain, tls = self.ratio(False), self.ratio(True)
        if plain is not None and tls is not None:
            goals["openbao"] = tls >= plain
        cryptd, bare = self.pairs.get("cryptd"), self.pairs.get("bare")
        if cryptd is not None and bare is not None:
            ours, theirs = cryptd.added_us, bare.added_us
            if ours is not None and theirs is not None:
                goals["hot_path"] = ours <= theirs
        if cryptd is not None:
            goals["no_errors"] = cryptd.plain.errors == 0 and cryptd.tls.errors == 0
        return goals

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "title": self.title,
            "pairs": {kind: pair.to_json() for kind, pair in self.pairs.items()},
            "ratio_plain": self.ratio(False),
            "ratio_tls": self.ratio(True),
            "goals": self.goals(),
        }


def negotiated(url: str) -> str:
    """The TLS version and suite a client with this machine's OpenSSL gets from ``url`` (an
    observation for the report: the certificate is not checked here)."""
    parts = urlsplit(url)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection((parts.hostname, parts.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=parts.hostname) as sock,
    ):
        cipher = sock.cipher()
        return f"{sock.version()} {cipher[0] if cipher else '?'}"


# --------------------------------------------------------------------------------------------
# The run


def run_rounds(
    targets: Mapping[str, AnyTarget],
    prepared: Mapping[str, Prepared],
    signers: Mapping[str, Cryptd],
    plan: Plan,
) -> dict[str, dict[str, list[Measurement]]]:
    """Every scenario against every target that runs it, each server's plain and TLS targets
    side by side, the order reversed round by round."""

    def labels_of(name: str) -> list[str]:
        chosen = []
        for kind in KINDS:
            if kind == "bare" and name != CEILING_SCENARIO:
                continue
            for tls in (False, True):
                key = label(kind, tls)
                if key in targets and (prepared_name(kind), name) in bodies(key).files:
                    chosen.append(key)
        return chosen

    def bodies(key: str) -> Prepared:
        # The bare app gets the requests of the cryptd it stands beside, signed as for it.
        return prepared[label("cryptd", key.endswith("-tls")) if key.startswith("bare") else key]

    def once(key: str, name: str, duration: float) -> Measurement:
        return measure(
            targets[key], BY_NAME[name], bodies(key), plan, duration, signer=signers.get(key)
        )

    runs: dict[str, dict[str, list[Measurement]]] = {name: {} for name in plan.scenarios}
    log("warm-up")
    for name in plan.scenarios:
        for key in labels_of(name):
            once(key, name, plan.warmup)
    for round_no in range(plan.rounds):
        for name in plan.scenarios:
            chosen = labels_of(name)
            for key in chosen if round_no % 2 == 0 else chosen[::-1]:
                m = quietly(plan, partial(once, key, name, plan.duration))
                runs[name].setdefault(key, []).append(m)
                log(f"round {round_no + 1}/{plan.rounds} {name} {key}: {describe(m)}")
    return runs


def prepared_name(kind: str) -> str:
    """The target name bodies are prepared under (the bare app gets cryptd's)."""
    return "openbao" if kind == "openbao" else "cryptd"


def results(
    runs: Mapping[str, Mapping[str, Sequence[Measurement]]], cores: int
) -> list[ScenarioResult]:
    out = []
    for name, by_label in runs.items():
        pairs = {}
        for kind in KINDS:
            plain, tls = by_label.get(label(kind, False)), by_label.get(label(kind, True))
            if plain and tls:
                pairs[kind] = Pair(summarize(plain, cores), summarize(tls, cores), cores)
        out.append(ScenarioResult(name, BY_NAME[name].title, pairs))
    return out


# --------------------------------------------------------------------------------------------
# Tables


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def hot_path_table(result: ScenarioResult) -> str:
    rows = [
        "| server | plain req/s per server core | TLS req/s per server core | TLS / plain "
        "| server CPU us/request plain / TLS | TLS adds us/request | wrk CPU us/request plain / "
        "TLS | P99 ms plain / TLS | errors plain / TLS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("bare", "cryptd"):
        pair = result.pairs.get(kind)
        if pair is None:
            continue
        rows.append(
            f"| {LABELS[kind]} | {_num(pair.plain.rps / pair.cores)} "
            f"| {_num(pair.tls.rps / pair.cores)} | {_x(pair.tls_ratio)} "
            f"| {_num(pair.plain.server_cpu_per_request_us)} / "
            f"{_num(pair.tls.server_cpu_per_request_us)} | {_num(pair.added_us, 1)} "
            f"| {_num(pair.plain.client_cpu_per_request_us)} / "
            f"{_num(pair.tls.client_cpu_per_request_us)} "
            f"| {pair.plain.p99_ms:.2f} / {pair.tls.p99_ms:.2f} "
            f"| {pair.plain.errors} / {pair.tls.errors} |"
        )
    return "\n".join(rows)


def openbao_table(found: Sequence[ScenarioResult]) -> str:
    rows = [
        "| scenario | cryptd plain | OpenBao plain | ratio plain | cryptd TLS | OpenBao TLS "
        "| ratio TLS | TLS / plain: cryptd, OpenBao | P99 ms TLS: cryptd / OpenBao "
        "| errors (c/o, plain + TLS) | goals |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in found:
        cryptd, bao = result.pairs.get("cryptd"), result.pairs.get("openbao")
        if cryptd is None or bao is None:
            continue
        goals = result.goals()
        failed = [k for k, ok in goals.items() if not ok and k != "hot_path"]
        verdict = "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"
        per_core = cryptd.cores
        rows.append(
            f"| {result.title} | {_num(cryptd.plain.ops / per_core)} "
            f"| {_num(bao.plain.ops / per_core)} | {_x(result.ratio(False))} "
            f"| {_num(cryptd.tls.ops / per_core)} | {_num(bao.tls.ops / per_core)} "
            f"| {_x(result.ratio(True))} | {_x(cryptd.tls_ratio)}, {_x(bao.tls_ratio)} "
            f"| {cryptd.tls.p99_ms:.2f} / {bao.tls.p99_ms:.2f} "
            f"| {cryptd.plain.errors + cryptd.tls.errors} / {bao.plain.errors + bao.tls.errors} "
            f"| {verdict} |"
        )
    return "\n".join(rows)


def summary(
    result: dict[str, Any], found: Sequence[ScenarioResult], mixes: Sequence[MixResult] = ()
) -> str:
    """The docs' section: what ran, the hot-path table, the OpenBao table and the mixes."""
    cfg, tls = result["config"], result["tls"]
    production = cfg.get("production", False)
    setup = (
        "signing, replay protection on a Redis of its own, metrics and the audit log (a file, "
        "group fsync, fail-closed) on"
        if production
        else "signing, metrics and audit on"
    )
    phase = result.get("phase")
    lines = [
        f"Run of {result['started']} on `{result['machine']['git_head']}` ({cfg['topology']}; "
        f"{served_by(result['machine'])}load average {' '.join(result['machine']['loadavg'])} "
        "at start), wrk "
        f"-t{cfg['threads']} -c{cfg['connections']} on keep-alive connections, "
        f"{cfg['duration']:.0f} s x {cfg['rounds']} round(s), medians; cryptd with "
        f"{cfg['workers']} worker(s), {setup}. "
        + (
            f"Host phase: {describe_phase(phase['before'])} before, {phase['after']:.0f} us after. "
            if phase
            else ""
        )
        + f"TLS negotiated: cryptd "
        f"{tls.get('cryptd', '-')}, bare ASGI {tls.get('bare', '-')} (cryptd's certificate and "
        f"TLS context), OpenBao {tls.get('openbao', '-')} (`-dev-tls`, its own certificate)"
        + (
            "; OpenBao with its file audit device (a request and a response entry a request, "
            "values HMAC'd, written without a sync). "
            if cfg.get("openbao_audit")
            else ". "
        )
        + f"Reproduced by `{cfg['command']}`.",
    ]
    ceiling = next((r for r in found if "bare" in r.pairs), None)
    if ceiling is not None:
        ok = ceiling.goals().get("hot_path")
        lines += [
            "",
            f"{ceiling.title}: TLS against plain, cryptd beside the bare-ASGI app (same "
            "requests, same certificate, same core):",
            "",
            hot_path_table(ceiling),
            "",
            "Goal (TLS adds no more server CPU per request to cryptd than to the bare app): "
            + _verdict(ok),
        ]
    if any("openbao" in r.pairs for r in found):
        lines += [
            "",
            "cryptd against OpenBao, ops/s per server core, both plain and both over TLS:",
            "",
            openbao_table(found),
            "",
            "Goal (cryptd's ratio with TLS on both sides no worse than without; no errors): "
            + _verdict(all(ok for r in found for k, ok in r.goals().items() if k != "hot_path")),
        ]
    runs = result.get("runs")
    if runs and any("openbao" in r.pairs for r in found):
        lines += [
            "",
            "cryptd / OpenBao ops/s in every round (the order of the targets reversed each round):",
            "",
            rounds_table(runs, cfg["rounds"]),
        ]
    for mix in mixes:
        lines += [
            "",
            f"Mixed traffic over TLS (cryptd and OpenBao each over its own TLS): {mix.mix.title}:",
            "",
            mix.table(),
        ]
    return "\n".join(lines)


def render(
    result: dict[str, Any], found: Sequence[ScenarioResult], mixes: Sequence[MixResult] = ()
) -> str:
    m = result["machine"]
    return "\n".join(
        [
            f"# TLS on against off ({result['started']})",
            "",
            f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, "
            f"{interpreter_of(m)}, {m['openbao']}, {m['wrk']}.",
            "",
            summary(result, found, mixes),
        ]
    )


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.tls", description=__doc__.split("\n\n")[0]
    )
    add_load_options(parser, "smoke run (3 s, 1 round)")
    parser.add_argument(
        "--scenarios",
        help="comma-separated scenarios and mixes (default: every scenario OpenBao runs too, and"
        f" the mix; the bare-ASGI ceiling is measured beside {CEILING_SCENARIO})",
    )
    add_topology_options(parser)
    parser.add_argument("--workers", type=int, default=1, help="cryptd server workers (1)")
    add_cryptd_env_option(parser)
    parser.add_argument("--no-openbao", action="store_true", help="cryptd and the bare app only")
    parser.add_argument(
        "--no-openbao-audit",
        action="store_true",
        help="with --production: OpenBao without its file audit device",
    )
    parser.add_argument(
        "--production",
        action="store_true",
        help="cryptd as in production: replay store on a Redis of the run's own, audit to a "
        "file (group fsync, fail-closed), metrics; 5 rounds unless --rounds says otherwise",
    )
    add_quiet_options(parser)
    add_output_options(parser)
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.production and args.rounds is None and not args.quick:
        args.rounds = 5
    default = (*CALIBRATION_DEFAULT, *MIX_BY_NAME)
    chosen = tuple(args.scenarios.split(",")) if args.scenarios else default
    unknown = [name for name in chosen if name not in BY_NAME and name not in MIX_BY_NAME]
    if unknown:
        known = ", ".join([*BY_NAME, *MIX_BY_NAME])
        raise SystemExit(f"unknown scenarios: {', '.join(unknown)} (known: {known})")
    return Plan(
        **load_settings(args),
        case_rate=0.0,
        case_duration=0.0,
        calibration=0.0,
        calibration_scenarios=(),
        scenarios=tuple(s.name for s in SCENARIOS if s.name in chosen),
        mixes=tuple(name for name in MIX_BY_NAME if name in chosen),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if wrk_missing():
        return 2
    topology = plan.topology
    cpus = topology.server_cpus
    with session(plan, "cryptd-loadtest-tls-", args.keep) as current:
        workdir, result = current.workdir, current.result
        phase_before = rsa_sign_us()
        log(describe_phase(phase_before))
        openbao_audit = args.production and not args.no_openbao_audit
        with contextlib.ExitStack() as stack:
            targets: dict[str, AnyTarget] = {}
            cryptds: dict[bool, Cryptd] = {}
            redis_url = None
            if args.production:
                redis = PrivateRedis(workdir / "redis", cpus)
                stack.callback(redis.stop)
                redis.start()
                redis_url = redis.url
                log(f"replay store: Redis at {redis_url}")
            for tls in (False, True):
                directory = workdir / label("cryptd", tls)
                extra = production_env(directory, redis_url) if redis_url else {}
                extra.update(args.cryptd_env)
                cryptd = Cryptd(directory, args.workers, extra, cpus, tls)
                stack.callback(cryptd.stop)
                cryptd.start()
                cryptds[tls] = targets[label("cryptd", tls)] = cryptd
                log(f"cryptd at {cryptd.url}")
            bare_plain = Bare(workdir / "bare-plain", cpus)
            bare_tls = Bare(
                workdir / "bare-tls", cpus, cryptds[True].tls_files, cryptds[True].ca_file
            )
            if CEILING_SCENARIO in plan.scenarios:
                for key, bare in (("bare-plain", bare_plain), ("bare-tls", bare_tls)):
                    stack.callback(bare.stop)
                    bare.start()
                    targets[key] = bare
                    log(f"bare-ASGI app at {bare.url}")
            if not args.no_openbao:
                for tls in (False, True):
                    bao = OpenBao(workdir / label("openbao", tls), cpus, tls, openbao_audit)
                    stack.callback(bao.stop)
                    bao.start()
                    targets[label("openbao", tls)] = bao
                    log(f"OpenBao at {bao.url}")
            scenarios = [BY_NAME[name] for name in plan.scenarios]
            prepared = {
                key: prepare([target], scenarios, workdir / "bodies" / key)
                for key, target in targets.items()
                if not isinstance(target, Bare)
            }
            signers = {"bare-plain": cryptds[False], "bare-tls": cryptds[True]}
            result["tls"] = {
                kind: negotiated(targets[label(kind, True)].url)
                for kind in KINDS
                if label(kind, True) in targets
            }
            result["config"] = {
                **current.config("loadtest.tls", argv),
                "workers": args.workers,
                "cryptd_env": dict(cryptds[True].env),
                "production": args.production,
                "openbao_audit": openbao_audit,
            }
            runs = run_rounds(targets, prepared, signers, plan)
            found = results(runs, topology.server_cores)
            result["runs"] = {
                name: {key: [m.to_json() for m in ms] for key, ms in by_label.items()}
                for name, by_label in runs.items()
            }
            result["results"] = [r.to_json() for r in found]
            mixes = mixes_over_tls(cryptds[True], targets, plan, workdir / "bodies" / "mix")
            result["mixes"] = [mix.to_json() for mix in mixes]
        result["phase"] = {"before": phase_before, "after": rsa_sign_us()}
        write_outputs(
            current, args, "tls", render(result, found, mixes), summary(result, found, mixes)
        )
    return 0


def mixes_over_tls(
    cryptd: Cryptd, targets: Mapping[str, AnyTarget], plan: Plan, bodies: Path
) -> list[MixResult]:
    """The plan's mixes against cryptd over TLS and OpenBao over its TLS (when it runs)."""
    if not plan.mixes:
        return []
    bao = targets.get(label("openbao", True))
    bao = bao if isinstance(bao, OpenBao) else None
    streams = {name for mix in plan.mixes for name, _ in MIX_BY_NAME[mix].streams}
    scenarios = [s for s in SCENARIOS if s.name in streams]
    prepared = prepare([cryptd] + ([bao] if bao is not None else []), scenarios, bodies)
    return run_mixes(cryptd, bao, prepared, plan)


def production_env(directory: Path, redis_url: str) -> dict[str, str]:
    """cryptd's environment as production runs it, beyond ``serve --dev``: the replay store on
    Redis, the audit log to a file whose records are made durable (group fsync) before their
    answers, refusing requests when they cannot be, and metrics."""
    return {
        "CRYPTD_REDIS_URL": redis_url,
        "CRYPTD_AUDIT_LOG": str(directory / "audit.log"),
        "CRYPTD_AUDIT_FAIL_CLOSED": "true",
        "CRYPTD_METRICS": "true",
    }


if __name__ == "__main__":
    sys.exit(main())
