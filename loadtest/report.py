"""Aggregation of the rounds (medians), the issue's goals, and the tables (Markdown)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from loadtest.measure import Measurement

THROUGHPUT_GOAL: Final = 1.5  # cryptd ops/s >= 1.5 x OpenBao's
P99_GOAL: Final = 1 / 2  # cryptd P99 <= OpenBao's / 2 at the same connection count
CASE_P99_GOAL: Final = 1.0  # case study: cryptd P99 <= OpenBao's


@dataclass(frozen=True)
class Summary:
    """Medians over the rounds of one (scenario, target)."""

    rounds: int
    ops: float
    rps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    errors: int
    requests: int
    ops_per_cpu_second: float | None
    server_cpu_per_request_us: float | None
    client_cpu_per_request_us: float | None
    others_cpu_share: float | None  # median share of the run's wall time x cores used by others
    ops_spread: float  # (max - min) / median of ops over the rounds

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def summarize(runs: Sequence[Measurement], cores: int) -> Summary:
    ops = [m.ops for m in runs]
    median_ops = statistics.median(ops)
    return Summary(
        rounds=len(runs),
        ops=median_ops,
        rps=statistics.median(m.rps for m in runs),
        p50_ms=statistics.median(m.p50_ms for m in runs),
        p99_ms=statistics.median(m.p99_ms for m in runs),
        max_ms=max(m.max_ms for m in runs),
        errors=sum(m.errors for m in runs),
        requests=sum(m.requests for m in runs),
        ops_per_cpu_second=_median(m.ops_per_cpu_second for m in runs),
        server_cpu_per_request_us=_median(
            m.server_cpu_s / m.requests * 1e6 if m.server_cpu_s and m.requests else None
            for m in runs
        ),
        client_cpu_per_request_us=_median(
            m.client_cpu_s / m.requests * 1e6 if m.client_cpu_s and m.requests else None
            for m in runs
        ),
        others_cpu_share=_median(
            m.others_cpu_s / (m.seconds * cores) if m.others_cpu_s is not None else None
            for m in runs
        ),
        ops_spread=(max(ops) - min(ops)) / median_ops if median_ops else 0.0,
    )


@dataclass(frozen=True)
class Comparison:
    scenario: str
    title: str
    cryptd: Summary
    openbao: Summary | None

    @property
    def ratio(self) -> float | None:
        if self.openbao is None or not self.openbao.ops:
            return None
        return self.cryptd.ops / self.openbao.ops

    @property
    def p99_ratio(self) -> float | None:
        if self.openbao is None or not self.openbao.p99_ms:
            return None
        return self.cryptd.p99_ms / self.openbao.p99_ms

    def goals(self) -> dict[str, bool] | None:
        ratio, p99_ratio = self.ratio, self.p99_ratio
        if ratio is None or p99_ratio is None:
            return None
        return {
            "throughput": ratio >= THROUGHPUT_GOAL,
            "p99": p99_ratio <= P99_GOAL,
            "no_errors": self.cryptd.errors == 0,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "title": self.title,
            "cryptd": self.cryptd.to_json(),
            "openbao": self.openbao.to_json() if self.openbao else None,
            "ratio": self.ratio,
            "p99_ratio": self.p99_ratio,
            "goals": self.goals(),
        }


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _verdict(goals: dict[str, bool] | None) -> str:
    if goals is None:
        return "n/a"
    failed = [name for name, ok in goals.items() if not ok]
    return "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"


def comparison_table(rows: Sequence[Comparison], server_cores: int = 1) -> str:
    """Operations per second per server core (the batch in items), server CPU per request,
    latency, and the goals."""
    lines = [
        "| scenario | cryptd ops/s per server core | OpenBao ops/s per server core | ratio "
        "| server CPU us/request (c/o) | cryptd P50 / P99 ms "
        "| OpenBao P50 / P99 ms | P99 ratio | errors (c/o) | goals |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        bao = row.openbao
        cpu = (
            f"{_num(row.cryptd.server_cpu_per_request_us)} / "
            f"{_num(bao.server_cpu_per_request_us) if bao else '-'}"
        )
        lines.append(
            f"| {row.title} | {_num(row.cryptd.ops / server_cores)} "
            f"| {_num(bao.ops / server_cores) if bao else '-'} "
            f"| {_ratio(row.ratio)} | {cpu} | {_ms(row.cryptd.p50_ms)} / {_ms(row.cryptd.p99_ms)} "
            f"| {(_ms(bao.p50_ms) + ' / ' + _ms(bao.p99_ms)) if bao else '-'} "
            f"| {_ratio(row.p99_ratio)} | {row.cryptd.errors} / {bao.errors if bao else '-'} "
            f"| {_verdict(row.goals())} |"
        )
    return "\n".join(lines)


def capacity_table(rows: Sequence[Comparison]) -> str:
    """Sizing: operations per server CPU second (one core fully busy), both targets."""
    lines = [
        "| scenario | cryptd ops per core-second | cryptd server CPU us/request "
        "| client (wrk) CPU us/request | OpenBao ops per core-second | others' CPU share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        bao = row.openbao
        share = row.cryptd.others_cpu_share
        lines.append(
            f"| {row.title} | {_num(row.cryptd.ops_per_cpu_second)} "
            f"| {_num(row.cryptd.server_cpu_per_request_us)} "
            f"| {_num(row.cryptd.client_cpu_per_request_us)} "
            f"| {_num(bao.ops_per_cpu_second) if bao else '-'} "
            f"| {'-' if share is None else f'{share:.0%}'} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class CaseStudy:
    rate: float
    duration: float
    cryptd: list[Measurement]
    openbao: list[Measurement]

    def medians(self, runs: Sequence[Measurement]) -> dict[str, float | None]:
        return {
            "achieved_rps": _median(m.rps for m in runs),
            "p50_ms": _median(m.p50_ms for m in runs),
            "p90_ms": _median(m.detail.get("p90_ms") for m in runs),
            "p99_ms": _median(m.p99_ms for m in runs),
            "max_ms": max((m.max_ms for m in runs), default=None),
            "errors": sum(m.errors for m in runs),
            "send_lag_p99_ms": _median(m.detail.get("send_lag_p99_ms") for m in runs),
            "server_cpu_per_request_us": _median(
                m.server_cpu_s / m.requests * 1e6 if m.server_cpu_s and m.requests else None
                for m in runs
            ),
        }

    def goal(self) -> bool | None:
        ours, theirs = self.medians(self.cryptd)["p99_ms"], self.medians(self.openbao)["p99_ms"]
        if ours is None or theirs is None:
            return None
        return ours <= theirs * CASE_P99_GOAL and not self.medians(self.cryptd)["errors"]

    def table(self) -> str:
        lines = [
            "| target | offered req/s | achieved req/s | P50 ms | P90 ms | P99 ms | max ms "
            "| errors | generator lag P99 ms | server CPU us/request |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, runs in (("cryptd", self.cryptd), ("OpenBao", self.openbao)):
            if not runs:
                continue
            m = self.medians(runs)
            lines.append(
                f"| {name} | {self.rate:,.0f} | {_num(m['achieved_rps'])} | {_ms(m['p50_ms'])} "
                f"| {_ms(m['p90_ms'])} | {_ms(m['p99_ms'])} | {_ms(m['max_ms'])} "
                f"| {_num(m['errors'])} | {_ms(m['send_lag_p99_ms'])} "
                f"| {_num(m['server_cpu_per_request_us'])} |"
            )
        goal = self.goal()
        verdict = "n/a" if goal is None else ("PASS" if goal else "FAIL")
        lines.append("")
        lines.append(f"Case-study goal (cryptd P99 <= OpenBao P99, no errors): {verdict}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "duration": self.duration,
            "cryptd": self.medians(self.cryptd),
            "openbao": self.medians(self.openbao),
            "goal": self.goal(),
            "runs": {
                "cryptd": [m.to_json() for m in self.cryptd],
                "openbao": [m.to_json() for m in self.openbao],
            },
        }


CEILING_SHARE_GOAL: Final = 0.30  # cryptd's AES-GCM encrypt >= 30 % of the bare-ASGI ceiling
MIX_GOAL: Final = 1.5  # each stream of the mix >= 1.5 x OpenBao's
MIX_P99_GOAL: Final = 2.0  # the cheap stream's P99 in the mix <= 2 x its P99 alone


@dataclass(frozen=True)
class Ceiling:
    """The bare-ASGI app on the same CPUs with the same requests, beside cryptd's scenario."""

    scenario: str
    cryptd: Summary
    bare: Summary

    @property
    def share(self) -> float | None:
        return self.cryptd.rps / self.bare.rps if self.bare.rps else None

    @property
    def own_us(self) -> float | None:
        """cryptd's own CPU per request: its server CPU minus the bare server's."""
        ours, theirs = self.cryptd.server_cpu_per_request_us, self.bare.server_cpu_per_request_us
        return None if ours is None or theirs is None else ours - theirs

    def goal(self) -> bool | None:
        share = self.share
        return None if share is None else share >= CEILING_SHARE_GOAL

    def verdict(self) -> str:
        """The share against its goal, to a tenth of a percent: a rounded 30 % can be a miss."""
        share = self.share
        return (
            f"{'-' if share is None else f'{share:.1%}'} "
            f"(goal >= {CEILING_SHARE_GOAL:.0%}: {_verdict_bool(self.goal())})"
        )

    def table(self) -> str:
        own = self.own_us
        lines = [
            "| server | req/s | server CPU us/request | P50 / P99 ms |",
            "|---|---:|---:|---:|",
            f"| bare ASGI (uvicorn + uvloop + httptools, fixed 1.4 KB answer) "
            f"| {_num(self.bare.rps)} | {_num(self.bare.server_cpu_per_request_us)} "
            f"| {_ms(self.bare.p50_ms)} / {_ms(self.bare.p99_ms)} |",
            f"| cryptd {self.scenario} | {_num(self.cryptd.rps)} "
            f"| {_num(self.cryptd.server_cpu_per_request_us)} "
            f"| {_ms(self.cryptd.p50_ms)} / {_ms(self.cryptd.p99_ms)} |",
            "",
            f"cryptd's share of the ceiling: {self.verdict()}; cryptd's own work: "
            f"{'-' if own is None else f'{own:.0f}'} us of server CPU per request.",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "cryptd": self.cryptd.to_json(),
            "bare": self.bare.to_json(),
            "share": self.share,
            "own_us": self.own_us,
            "goal": self.goal(),
        }


def _verdict_bool(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


@dataclass(frozen=True)
class MixResult:
    """A mix's rounds: per target, each round's figures per stream, and the ``alone`` stream
    measured by itself."""

    mix: Any  # loadtest.scenarios.Mix
    mixed: dict[str, list[dict[str, Measurement]]]
    alone: dict[str, list[Measurement]]
    server_cores: int

    def stream(self, target: str, name: str) -> Summary | None:
        runs = [r[name] for r in self.mixed.get(target, []) if name in r]
        return summarize(runs, self.server_cores) if runs else None

    def alone_summary(self, target: str) -> Summary | None:
        runs = self.alone.get(target) or []
        return summarize(runs, self.server_cores) if runs else None

    def goals(self) -> dict[str, bool] | None:
        found: dict[str, bool] = {}
        for name, _ in self.mix.streams:
            ours, theirs = self.stream("cryptd", name), self.stream("openbao", name)
            if ours is None or theirs is None or not theirs.ops:
                return None
            found[f"{name} throughput"] = ours.ops / theirs.ops >= MIX_GOAL
        cheap, alone = self.stream("cryptd", self.mix.alone), self.alone_summary("cryptd")
        if cheap is not None and alone is not None and alone.p99_ms:
            found[f"{self.mix.alone} P99"] = cheap.p99_ms <= MIX_P99_GOAL * alone.p99_ms
        return found

    def table(self) -> str:
        lines = [
            "| stream | connections | cryptd ops/s | OpenBao ops/s | ratio | cryptd P50 / P99 ms "
            "| OpenBao P50 / P99 ms | errors (c/o) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, connections in self.mix.streams:
            ours, theirs = self.stream("cryptd", name), self.stream("openbao", name)
            ratio = ours.ops / theirs.ops if ours and theirs and theirs.ops else None
            lines.append(
                f"| {name} | {connections} | {_num(ours.ops) if ours else '-'} "
                f"| {_num(theirs.ops) if theirs else '-'} | {_ratio(ratio)} "
                f"| {(_ms(ours.p50_ms) + ' / ' + _ms(ours.p99_ms)) if ours else '-'} "
                f"| {(_ms(theirs.p50_ms) + ' / ' + _ms(theirs.p99_ms)) if theirs else '-'} "
                f"| {ours.errors if ours else '-'} / {theirs.errors if theirs else '-'} |"
            )
        connections = dict(self.mix.streams)[self.mix.alone]
        for target, label in (("cryptd", "cryptd"), ("openbao", "OpenBao")):
            alone = self.alone_summary(target)
            if alone is not None:
                lines.append(
                    f"| {self.mix.alone} alone ({label}) | {connections} | "
                    + (
                        f"{_num(alone.ops)} | - | - | {_ms(alone.p50_ms)} / {_ms(alone.p99_ms)} "
                        f"| - | {alone.errors} / - |"
                        if target == "cryptd"
                        else f"- | {_num(alone.ops)} | - | - "
                        f"| {_ms(alone.p50_ms)} / {_ms(alone.p99_ms)} | - / {alone.errors} |"
                    )
                )
        goals = self.goals()
        if goals:
            lines += [
                "",
                "Goals (each stream >= 1.5x OpenBao; the cheap stream's P99 <= 2x its P99 alone): "
                + ", ".join(f"{k} {_verdict_bool(v)}" for k, v in goals.items()),
            ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        def summary(s: Summary | None) -> dict[str, Any] | None:
            return s.to_json() if s else None

        return {
            "mix": self.mix.name,
            "streams": {
                name: {t: summary(self.stream(t, name)) for t in self.mixed}
                for name, _ in self.mix.streams
            },
            "alone": {t: summary(self.alone_summary(t)) for t in self.alone},
            "goals": self.goals(),
            "runs": {
                t: [{n: m.to_json() for n, m in r.items()} for r in rounds]
                for t, rounds in self.mixed.items()
            },
        }
