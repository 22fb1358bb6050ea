"""The fault campaign's Markdown report (docs/results/faults-<date>.md by default)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from loadtest.faults_load import Integrity, Outcome, ReplayResult
from loadtest.faults_revocation import Round


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class PhaseResult:
    """One fault: when it ran (monotonic) and what was measured around it."""

    name: str
    target: str
    started: float
    fault_at: float = 0.0
    ended: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    recovered_s: float | None = None  # fault -> every host ready and in the balancer again
    replay: ReplayResult | None = None
    notes: list[str] = field(default_factory=list)
    timeline_from: float = 0.0  # wall clock of the fault, for the machines' logs (0: none)

    def outcomes(self, all_outcomes: list[Outcome]) -> list[Outcome]:
        return [o for o in all_outcomes if self.started <= o.at < self.ended]


@dataclass
class Refusals:
    requests: int
    accepted: int
    by_status: Counter[int]
    window_s: float  # the longest stretch clients were refused (see refusal_window; 0: none)
    span_s: float  # first to last refusal after the fault (0: none)
    bad_5xx: int  # 5xx other than 503
    without_retry_after: int  # 503 without Retry-After


def refusal_window(outcomes: list[Outcome]) -> float:
    """The longest stretch during which clients were refused: over ``outcomes`` in the order
    they were sent, each run of consecutive refusals lasts from its first refusal's send time
    to the send time of the next accepted request (or to the run's last answer, when nothing
    was accepted after it). Two refusals 22 s apart with acceptances between are two short
    stretches, not a 22-second outage."""
    longest = 0.0
    run_from: float | None = None
    last_answer = 0.0
    for o in sorted(outcomes, key=lambda o: o.sent_at):
        if 200 <= o.status < 300:
            if run_from is not None:
                longest = max(longest, o.sent_at - run_from)
                run_from = None
            continue
        if run_from is None:
            run_from, last_answer = o.sent_at, o.at
        last_answer = max(last_answer, o.at)
    if run_from is not None:
        longest = max(longest, last_answer - run_from)
    return longest


def refusals(phase: PhaseResult, outcomes: list[Outcome]) -> Refusals:
    mine = phase.outcomes(outcomes)
    failed = [o for o in mine if not 200 <= o.status < 300]
    after = [o.at for o in failed if o.at >= phase.fault_at]
    return Refusals(
        requests=len(mine),
        accepted=len(mine) - len(failed),
        by_status=Counter(o.status for o in failed),
        window_s=refusal_window([o for o in mine if o.at >= phase.fault_at]),
        span_s=(max(after) - min(after)) if after else 0.0,
        bad_5xx=sum(1 for o in failed if o.status >= 500 and o.status != 503),
        without_retry_after=sum(1 for o in failed if o.status == 503 and not o.retry_after),
    )


def _refusal_times(phase: PhaseResult, outcomes: list[Outcome], shown: int = 8) -> str:
    """When the refusals after the fault came (seconds after it) and what they said: a
    first-to-last window of a few scattered refusals is not an outage."""
    failed = [
        o for o in phase.outcomes(outcomes) if not 200 <= o.status < 300 and o.at >= phase.fault_at
    ]
    if not failed:
        return ""
    causes = Counter(f"{o.status or 'no answer'} {o.reason}".strip() for o in failed)
    first = ", ".join(f"+{o.at - phase.fault_at:.2f}" for o in failed[:shown])
    more = f" (and {len(failed) - shown} more)" if len(failed) > shown else ""
    said = "; ".join(f"{cause} x{n}" for cause, n in causes.most_common(4))
    return f"- {phase.name}: refusals at {first} s{more}; {said}"


def _lost_answers(phase: PhaseResult, outcomes: list[Outcome]) -> str:
    """Calls accepted after attempts that got no answer (the client sent them again, signed
    afresh): not refusals, but their clients waited; how long, from the first attempt."""
    served = [
        o
        for o in phase.outcomes(outcomes)
        if o.lost and 200 <= o.status < 300 and o.at >= phase.fault_at
    ]
    if not served:
        return ""
    why = Counter(name for o in served for name in o.lost)
    waits = [o.latency for o in served]
    return (
        f"- {phase.name}: {len(served)} calls accepted after an attempt without answer "
        f"({', '.join(f'{n} x{c}' for n, c in why.most_common())}), answered "
        f"{percentile(waits, 0.5):.2f} / {max(waits):.2f} s (median / max) after their "
        "first attempt left"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds == seconds else "—"


def _statuses(counter: Counter[int]) -> str:
    if not counter:
        return "none"
    return ", ".join(f"{'no answer' if s == 0 else s}x{n}" for s, n in sorted(counter.items()))


def _revocation_row(name: str, chosen: list[Round]) -> str:
    def known(values: list[float]) -> list[float]:
        return [v for v in values if v == v]

    times = [r.seconds for r in chosen]
    after = known([r.propagation for r in chosen])
    disabled = known([r.key_disabled_after for r in chosen])
    rtts = known([r.probe_rtt for r in chosen])
    waits = known([r.waited for r in chosen])
    return (
        f"| {name} | {len(chosen)} | {_ms(percentile(times, 0.5))} / "
        f"{_ms(percentile(times, 0.99))} / {_ms(max(times, default=float('nan')))} | "
        f"{_ms(percentile(after, 0.99))} | {sum(r.first_refused for r in chosen)} of "
        f"{sum(r.lanes for r in chosen)} | {sum(r.unrelated_first for r in chosen)} | "
        f"{_ms(percentile(disabled, 0.99))} | {_ms(percentile(rtts, 0.99))} | "
        f"{_ms(percentile(waits, 0.5))} / {_ms(percentile(waits, 0.99))} | "
        f"{sum(1 for r in chosen if r.confirmed < r.replicas or not r.replicas)} | "
        f"{sum(r.served_after for r in chosen)} | "
        f"{sum(r.served_after_refusal for r in chosen)} | "
        f"{sum(r.other_refusals for r in chosen)} | {sum(r.absent for r in chosen)} |"
    )


def render(
    *,
    title: str,
    setup: dict[str, str],
    phases: list[PhaseResult],
    outcomes: list[Outcome],
    rounds: list[Round],
    revocation_errors: list[str],
    integrity: Integrity,
    final_replay: ReplayResult,
) -> str:
    lines = [f"# {title}", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items()]
    lines += ["", "## Faults under load", ""]
    lines += [
        "*Refusal window*: the longest stretch during which clients were refused (from a "
        "refusal's send time to the next accepted request's, over runs of consecutive "
        "refusals in send order); *first to last refusal*: the span of all of them, which a "
        "few scattered refusals stretch without an outage.",
        "",
    ]
    lines += [
        "| fault | target | requests | accepted | refusals (status x count) | refusal window s "
        "| first to last refusal s | 5xx not 503 | 503 without Retry-After "
        "| all hosts serving again s after the fault | replays sent / got past |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in phases:
        r = refusals(phase, outcomes)
        rec = "—" if phase.recovered_s is None else f"{phase.recovered_s:.1f}"
        rp = phase.replay
        replay = "—" if rp is None else f"{rp.sent} / {rp.passed}"
        lines.append(
            f"| {phase.name} | {phase.target} | {r.requests} | {r.accepted} | "
            f"{_statuses(r.by_status)} | {r.window_s:.2f} | {r.span_s:.2f} | {r.bad_5xx} | "
            f"{r.without_retry_after} | {rec} | {replay} |"
        )
    notes = [f"- {p.name}: {n}" for p in phases for n in p.notes]
    notes += [line for p in phases if (line := _refusal_times(p, outcomes))]
    notes += [line for p in phases if (line := _lost_answers(p, outcomes))]
    details = [f"- {p.name}: {p.details}" for p in phases if p.details]
    if details or notes:
        lines += ["", *details, *notes]
    total_passed = final_replay.passed + sum(p.replay.passed for p in phases if p.replay)
    lines += ["", "## Replays", ""]
    lines.append(
        "After each fault, every request accepted during its phase, and up to 1,000 of those "
        "accepted earlier and young enough to pass the age check, was sent again, byte for "
        "byte, to every host (the table's last column); after the load stopped, those "
        "accepted since "
        f"the last fault: {final_replay.sent} sends, statuses "
        f"{_statuses(final_replay.by_status)}. **{total_passed} replays in all got past the "
        "signature and replay checks** (goal 0)."
    )
    lines += ["", "## Revocation across hosts", ""]
    lines += [
        "Each round creates a key, disables it with a `PATCH {state: disabled}` on one host, "
        "and from that answer on asks every reachable worker of every host to encrypt under "
        "it (one connection pinned to each worker), again and again until the worker answers "
        "`409 key_disabled`. What must hold: no worker serves the key after the answer. A "
        "worker that refuses every request at that moment (a Redis failover's `503 "
        "overloaded`, a full disk's `503 audit_unavailable`, HAProxy's `503` with no host "
        "ready) does not serve the key either, so any refusal counts as refusing it.",
        "",
        "- *probe bound*: from the answer until the last worker's counted refusal came back "
        "(that probe's round trip, and this process's CPU, in it);",
        "- *after the answer*: from the answer until the last worker's counted refusal was "
        "sent; a worker's counted refusal is its first refusal of any kind after which it "
        "served nothing (0 when that is its very first probe: the change was in force when "
        "the answer left, and that probe's send time is only this process waking up);",
        "- *workers refusing their first probe*: for any reason, of all workers probed;",
        "- *first refused for another reason*: the workers whose first answer was a refusal "
        "other than `key_disabled` (a 503 or 429);",
        "- *until `key_disabled`*: from the answer until every worker was seen answering "
        "`key_disabled` itself (a worker never seen doing so counts its last probe), the "
        "figure this report called *after the answer* before;",
        "- *probe round trip*: the slowest counted refusal, sent to answered;",
        "- *confirmation*: the answer's own `X-Cryptd-Propagation` wait, from the commit "
        "until every live replica enforced the change; *rounds not confirmed by every "
        "replica*: rounds whose answer names fewer confirmations than replicas;",
        "- *encryptions served after the answer*: every one, before or after a refusal "
        "(goal 0); *workers serving after a refusal*: those that served one after having "
        "refused (goal 0; such a worker's counted refusal is its next one);",
        "- *other refusals retried*: probes refused for another reason; *workers absent*: "
        "not reachable this round, or answering no probe.",
        "",
        "| phase | rounds | probe bound P50 / P99 / max ms | after the answer P99 ms "
        "| workers refusing their first probe | first refused for another reason "
        "| until `key_disabled` P99 ms | probe round trip P99 ms "
        "| confirmation P50 / P99 ms | rounds not confirmed by every replica "
        "| encryptions served after the answer | workers serving after a refusal "
        "| other refusals retried | workers absent |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = ["all", *dict.fromkeys(r.phase for r in rounds)]
    for name in names:
        chosen = rounds if name == "all" else [r for r in rounds if r.phase == name]
        lines.append(_revocation_row(name, chosen))
    if revocation_errors:
        lines += ["", f"Rounds that could not run ({len(revocation_errors)}), first ones:", ""]
        lines += [f"- {e}" for e in revocation_errors[:5]]
    lines += ["", "## Integrity after the campaign", ""]
    lines.append(
        f"- tokens made under load: {integrity.tokens}, no longer decrypting: "
        f"**{integrity.tokens_failed}** (goal 0)"
    )
    lines.append(
        f"- keys created/rotated with a 2xx answer: {integrity.keys}, lost or behind: "
        f"**{len(integrity.keys_lost)}** (goal 0) {', '.join(integrity.keys_lost[:10])}"
    )
    return "\n".join(lines) + "\n"
