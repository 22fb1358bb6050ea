"""This host's wall clock against the shared replay store's: measured, and judged (readiness).

A request is refused as signed in the future (401 ``future``) when its ``created`` is more
than ``max_skew`` seconds ahead of this host's clock: a host whose clock is behind the others'
by more than that refuses every correctly signed request that reaches it, while answering
everything else. Its clock ahead costs less: the shared store checks a request's age on its
own clock (service/auth/replay.py), so this host only lets requests expire early, and refuses
them all once it is ahead by nearly the maximum age.

A reference's clock is read within one round trip (Redis ``TIME``, pipelined with the
readiness probe's epoch check; the PostgreSQL key store's ``clock_timestamp()``, in the lease's
announcement every couple of seconds): the offset is taken at the round trip's midpoint, and
the reference read its clock somewhere within it, so the true offset lies within half the round
trip of the measured one. A clock is called off only when that uncertainty cannot explain it.

Redis is one machine shared by every host: were its clock stepped, every host would measure the
same offset. So a host leaves readiness for its clock only when two independent references
agree it is off (:func:`judge`); with one reference, or two that disagree, it is degraded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

REFERENCE: Final = "Redis TIME"


@dataclass(frozen=True)
class ClockOffset:
    """This host's clock minus the store's, in seconds (negative: this host is behind), and
    the uncertainty (half the round trip): the true offset is ``offset ± uncertainty``."""

    offset: float
    uncertainty: float

    @classmethod
    def measured(cls, sent: float, round_trip: float, store_time: float) -> ClockOffset:
        """``sent``: this host's clock when the command left; ``round_trip``: seconds until
        its reply was read (a monotonic clock: a step of the wall clock meanwhile does not
        count); ``store_time``: the store's clock in the reply."""
        half = max(0.0, round_trip) / 2
        return cls(sent + half - store_time, half)


@dataclass(frozen=True)
class Reading:
    """This host's clock measured against one named reference (``Redis TIME``, the key
    store's server clock)."""

    reference: str
    measured: ClockOffset


@dataclass(frozen=True)
class ClockVerdict:
    """``ok``: correctly signed requests are accepted; ``reason`` when they are not;
    ``degraded`` when they are, with less margin than they should have, or when a reference
    says they are not but the verdict may not rest on it alone."""

    ok: bool
    reason: str | None = None
    degraded: str | None = None


def _fault(measured: ClockOffset, max_skew: int, max_age: int) -> str | None:
    """What this offset costs correctly signed requests, counting only the part the
    uncertainty cannot explain: ``behind`` or ``expired`` (all refused), ``ahead`` (they
    expire early), None (nothing)."""
    surely_behind = -measured.offset - measured.uncertainty
    surely_ahead = measured.offset - measured.uncertainty
    if surely_behind > max_skew:
        return "behind"
    if surely_ahead > max(max_skew, max_age - max_skew):
        return "expired"
    if surely_ahead > max_skew:
        return "ahead"
    return None


def _offsets(readings: Sequence[Reading]) -> str:
    """``10.0 s behind Redis TIME and 9.9 s behind PostgreSQL clock_timestamp()``"""
    return " and ".join(
        f"{abs(r.measured.offset):.1f} s {'behind' if r.measured.offset < 0 else 'ahead of'} "
        f"{r.reference}"
        for r in readings
    )


def _cost(fault: str, offset: float, max_skew: int, max_age: int) -> str:
    if fault == "behind":
        return (
            f"correctly signed requests are refused as signed in the future (max skew {max_skew} s)"
        )
    if fault == "expired":
        return f"correctly signed requests are refused as expired (max age {max_age} s)"
    return (
        f"requests are still accepted (the replay store's clock bounds their age), but expire "
        f"here {offset:.1f} s early (max skew {max_skew} s, max age {max_age} s)"
    )


def _disagreement(readings: Sequence[Reading]) -> float:
    """How far the references surely disagree with each other (seconds; 0 with one)."""
    return max(
        (
            abs(a.measured.offset - b.measured.offset)
            - a.measured.uncertainty
            - b.measured.uncertainty
            for i, a in enumerate(readings)
            for b in readings[i + 1 :]
        ),
        default=0.0,
    )


def judge(readings: Sequence[Reading], max_skew: int, max_age: int) -> ClockVerdict:
    """What this host's clock costs correctly signed requests (their ``created`` set by a clock
    that agrees with the replay store's), from its offsets against independent references, the
    replay store's first. A host is taken out of service (not ready) only when at least two
    references agree that its clock is off beyond the limit: one shared machine's clock
    stepped would otherwise take every host out at once. One reference saying so, or references
    that disagree with each other by more than the max skew, make it degraded."""
    if not readings:
        return ClockVerdict(True)
    faults = [_fault(r.measured, max_skew, max_age) for r in readings]
    said = f"clock: this host's clock is {_offsets(readings)}"
    apart = _disagreement(readings)
    if apart > max_skew:
        return ClockVerdict(
            True,
            degraded=(
                f"{said}; not taken out of service: the references disagree by {apart:.1f} s "
                f"(more than the max skew {max_skew} s): one of them may be off"
            ),
        )
    # The replay store's reading speaks first (requests are checked against its clock).
    faulted = next((i for i, f in enumerate(faults) if f is not None), None)
    if faulted is None:
        return ClockVerdict(True)
    first = faults[faulted]
    assert first is not None
    cost = _cost(first, readings[faulted].measured.offset, max_skew, max_age)
    if first == "ahead":
        return ClockVerdict(True, degraded=f"{said}; {cost}")
    if len(readings) < 2:
        return ClockVerdict(
            True,
            degraded=(
                f"{said}; {cost}; not taken out of service: only one reference "
                f"({readings[0].reference}), and one machine's clock must not take every "
                "host out"
            ),
        )
    if all(f == first for f in faults):
        return ClockVerdict(False, reason=f"{said}; {cost}")
    return ClockVerdict(
        True,
        degraded=(
            f"{said}; {cost} by one reference; not taken out of service: the references do "
            "not both put it beyond the limit"
        ),
    )
