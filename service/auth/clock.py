"""This host's wall clock against the shared replay store's: measured, and judged (readiness).

A request is refused as signed in the future (401 ``future``) when its ``created`` is more
than ``max_skew`` seconds ahead of this host's clock: a host whose clock is behind the others'
by more than that refuses every correctly signed request that reaches it, while answering
everything else. Its clock ahead costs less: the shared store checks a request's age on its
own clock (service/auth/replay.py), so this host only lets requests expire early, and refuses
them all once it is ahead by nearly the maximum age.

The store's clock is read within one round trip (Redis ``TIME``, pipelined with the readiness
probe's epoch check): the offset is taken at the round trip's midpoint, and the store read its
clock somewhere within it, so the true offset lies within half the round trip of the measured
one. A clock is called off only when that uncertainty cannot explain it.
"""

from __future__ import annotations

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
class ClockVerdict:
    """``ok``: correctly signed requests are accepted; ``reason`` when they are not;
    ``degraded`` when they are, with less margin than they should have."""

    ok: bool
    reason: str | None = None
    degraded: str | None = None


def judge(measured: ClockOffset, max_skew: int, max_age: int) -> ClockVerdict:
    """What this host's clock costs correctly signed requests (their ``created`` set by a clock
    that agrees with the store's), counting only the part of the offset the uncertainty cannot
    explain."""
    offset = measured.offset
    surely_behind = -offset - measured.uncertainty
    surely_ahead = offset - measured.uncertainty
    if surely_behind > max_skew:
        return ClockVerdict(
            False,
            reason=(
                f"clock: this host's clock is {-offset:.1f} s behind the replay store's "
                f"({REFERENCE}); correctly signed requests are refused as signed in the "
                f"future (max skew {max_skew} s)"
            ),
        )
    if surely_ahead > max(max_skew, max_age - max_skew):
        return ClockVerdict(
            False,
            reason=(
                f"clock: this host's clock is {offset:.1f} s ahead of the replay store's "
                f"({REFERENCE}); correctly signed requests are refused as expired "
                f"(max age {max_age} s)"
            ),
        )
    if surely_ahead > max_skew:
        return ClockVerdict(
            True,
            degraded=(
                f"clock: this host's clock is {offset:.1f} s ahead of the replay store's "
                f"({REFERENCE}); requests are still accepted (the store's clock bounds their "
                f"age), but expire here {offset:.1f} s early (max skew {max_skew} s, "
                f"max age {max_age} s)"
            ),
        )
    return ClockVerdict(True)
