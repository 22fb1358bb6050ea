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
writes everything (every run) as JSON to ``loadtest/results/``; ``--record`` also keeps the
summary as ``docs/results/DATE-http.md``.

This module is the command; the plan, the measurements and the report are in
:mod:`loadtest.plan`, :mod:`loadtest.sampling`, :mod:`loadtest.campaign` and
:mod:`loadtest.run_report`.
"""

import argparse
import contextlib
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from loadtest import overhead
from loadtest.campaign import (
    CEILING_SCENARIO,
    calibrate_workers,
    metrics_cost,
    probe,
    run_case_study,
    run_mixes,
    run_rounds,
)
from loadtest.options import (
    add_cryptd_env_option,
    add_load_options,
    add_output_options,
    add_quiet_options,
    add_topology_options,
)
from loadtest.plan import (
    make_plan,
)
from loadtest.progress import log
from loadtest.report import (
    Ceiling,
    Comparison,
    summarize,
)
from loadtest.run_report import render, summary
from loadtest.sampling import (
    prepare,
)
from loadtest.scenarios import BY_NAME, CASE_STUDY, MIX_BY_NAME, SCENARIOS
from loadtest.servers import cryptd_env, redis_url
from loadtest.session import session, write_outputs, wrk_missing
from loadtest.targets import (
    Bare,
    Cryptd,
    OpenBao,
    PrivateRedis,
    Target,
)
from service.cli.bench import require_charts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.run", description=__doc__.split("\n\n")[0]
    )
    add_load_options(parser, "short smoke run")
    add_topology_options(parser.add_argument_group("topology"))
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
    add_cryptd_env_option(cryptd)
    parser.add_argument(
        "--scenarios",
        help="comma-separated subset of the scenarios and mixes, or 'pq' for the post-quantum"
        " ones (default: all but those; none: the case study alone)",
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
    add_quiet_options(parser)
    parser.add_argument(
        "--digest-every-request",
        action="store_true",
        help="wrk hashes every cryptd body anew in pure Lua (~100 MB/s: 1.6 ms of the shared"
        " cores per 140 KB batch). By default each unchanging body is hashed once per wrk"
        " thread; every request still gets a fresh nonce, created and HMAC",
    )
    parser.add_argument("--no-openbao", action="store_true", help="cryptd only")
    parser.add_argument("--metrics-cost", action="store_true", help="also measure metrics off")
    add_output_options(parser)
    parser.add_argument(
        "--chart",
        type=Path,
        metavar="FILE.png",
        help="also draw cryptd against OpenBao per scenario, throughput and P99 (charts extra)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.chart:
        try:
            require_charts()  # before the run, not after it
        except OSError as exc:
            print(f"loadtest.run: error: {exc}", file=sys.stderr)
            return 2
    plan = make_plan(args)
    if wrk_missing():
        return 2
    topology = plan.topology
    extra = dict(args.cryptd_env)
    with session(plan, "cryptd-loadtest-", args.keep) as current:
        workdir, result = current.workdir, current.result
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
                **current.config("loadtest.run", argv),
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
        write_outputs(
            current,
            args,
            "http",
            render(result, comparisons, case, ceiling, mixes),
            summary(result, comparisons, case, ceiling, mixes),
        )
        if args.chart:
            from loadtest.charts import comparison_chart

            log(f"chart: {comparison_chart(result, args.chart)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
