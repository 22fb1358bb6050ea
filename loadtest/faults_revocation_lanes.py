"""What each worker's probes after a revocation's answer say, and a round's figures from them.

Kept apart from the probing (:mod:`loadtest.faults_revocation`) so that the accounting can be
checked on made-up answers. The security property is that no worker *serves* the key once the
answer has left. A worker that refuses every request (a Redis failover's replay-store window
answers ``503 overloaded``, a full disk ``503 audit_unavailable``, HAProxy ``503`` with no host
ready) refuses the key too, so a refusal of any kind counts, provided the worker serves nothing
afterwards: one that serves an encryption after having refused is a violation, and its time is
the served one (it counts from its next refusal). How long the workers that first answered such
an unrelated refusal took to answer ``409 key_disabled`` is kept apart (``key_disabled_after``),
so that the wait for the key's own refusal is not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

REFUSED = (409, "key_disabled")  # the refusal a disabled key gets


@dataclass(frozen=True)
class Probe:
    """One encryption under the revoked key, sent after the answer (monotonic times)."""

    sent: float
    answered: float
    status: int
    code: str = ""  # the error code ("" when served)

    @property
    def served(self) -> bool:
        return self.status == 200

    @property
    def key_disabled(self) -> bool:
        return (self.status, self.code) == REFUSED


@dataclass(frozen=True)
class LaneReading:
    """One worker's probes, read against the answer's time."""

    refused_after: float  # answer -> send of the refusal that counts (0: the first probe)
    refused_back: float  # answer -> that refusal's answer (the served one's, if none)
    round_trip: float  # that probe, sent -> answered
    first_refused: bool  # its first probe was refused (for any reason)
    unrelated_first: bool  # ... for another reason than key_disabled (503, 429)
    key_disabled_after: float  # answer -> first key_disabled sent (0: first probe; else last)
    served: int  # encryptions served after the answer
    served_after_refusal: bool  # a violation: served after it had refused
    other_refusals: int  # refusals other than key_disabled


def read_lane(probes: list[Probe], answered: float) -> LaneReading | None:
    """The figures of one worker's probes (None: it answered none of them).

    The refusal that counts is the first one after the worker's last served probe; a worker
    whose first probe was refused and that served nothing later counts 0: the change was in
    force when the answer left (that probe's send time is this process's wake-up, not the
    server's). A worker still serving at its last probe counts that probe's time.
    """
    if not probes:
        return None
    served_at = [i for i, p in enumerate(probes) if p.served]
    last_served = served_at[-1] if served_at else -1
    counting = min(last_served + 1, len(probes) - 1)  # the refusal after it, if any
    chosen = probes[counting]
    first_refusal = next((i for i, p in enumerate(probes) if not p.served), len(probes))
    disabled = next((i for i, p in enumerate(probes) if p.key_disabled), len(probes) - 1)
    return LaneReading(
        refused_after=0.0 if counting == 0 and not chosen.served else chosen.sent - answered,
        refused_back=chosen.answered - answered,
        round_trip=chosen.answered - chosen.sent,
        first_refused=not probes[0].served,
        unrelated_first=not probes[0].served and not probes[0].key_disabled,
        key_disabled_after=0.0 if disabled == 0 else probes[disabled].sent - answered,
        served=len(served_at),
        served_after_refusal=last_served > first_refusal,
        other_refusals=sum(1 for p in probes if not p.served and not p.key_disabled),
    )


@dataclass(frozen=True)
class Figures:
    """A round's figures over its workers (see :class:`loadtest.faults_revocation.Round`)."""

    seconds: float
    propagation: float
    probe_rtt: float
    lanes: int
    first_refused: int
    unrelated_first: int
    key_disabled_after: float
    served_after: int
    served_after_refusal: int
    other_refusals: int


def figures(lanes: list[LaneReading]) -> Figures:
    """Over the workers that answered: the last one's times, the sums of the counts."""
    nan = float("nan")
    return Figures(
        seconds=max((w.refused_back for w in lanes), default=0.0),
        propagation=max((w.refused_after for w in lanes), default=0.0),
        probe_rtt=max((w.round_trip for w in lanes), default=nan),
        lanes=len(lanes),
        first_refused=sum(w.first_refused for w in lanes),
        unrelated_first=sum(w.unrelated_first for w in lanes),
        key_disabled_after=max((w.key_disabled_after for w in lanes), default=0.0),
        served_after=sum(w.served for w in lanes),
        served_after_refusal=sum(w.served_after_refusal for w in lanes),
        other_refusals=sum(w.other_refusals for w in lanes),
    )
