"""The runner's result as Markdown: the full report it prints, and the short summary that a
recorded run keeps under docs/results/."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from loadtest.machine import interpreter_of, served_by
from loadtest.report import (
    CaseStudy,
    Ceiling,
    Comparison,
    MixResult,
    capacity_table,
    comparison_table,
)


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


def summary(
    result: dict[str, Any],
    comparisons: list[Comparison],
    case: CaseStudy | None,
    ceiling: Ceiling | None,
    mixes: Sequence[MixResult],
) -> str:
    """The short form (what docs/results/ keeps): the main comparison, the case study, the ceiling
    and the mixes."""
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
