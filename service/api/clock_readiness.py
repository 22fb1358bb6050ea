"""The readiness check ``clock`` (with Redis): does this host's clock let correctly signed
requests through, judged against two independent references (service/auth/clock.py).

The first is the replay store's clock (Redis ``TIME``), measured by the ``replay_store``
check's own probe, listed just before; the second, where the key store has a server of its own
(PostgreSQL), that server's clock as the lease's last announcement read it (the key store hands
it over; this module knows nothing of how). Neither costs a round trip of its own, nor anything
per request. Redis is one machine shared by every host: a verdict that takes this host out of
service never rests on it alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from service.api.deps import ReadinessCheck
from service.api.replay_readiness import ReplayReadiness
from service.auth.clock import REFERENCE, ClockOffset, Reading, judge
from service.keys.store import ServerClock

# A key store reading older than this is not used (the announcements run every 2 s: several
# of them failed in a row, and the store's own check says why).
STALE: Final = 10.0


class ClockReadiness:
    """``on_offset(store, seconds)``: each offset measured against the key store's server
    (``cryptd_clock_offset_seconds{store="keystore"}``; the replay store's is reported by its
    probe)."""

    def __init__(
        self,
        replay: ReplayReadiness,
        server_clock: Callable[[], ServerClock | None],
        *,
        clock: Callable[[], float],
        max_skew: int,
        max_age: int,
        on_offset: Callable[[str, float], None],
    ) -> None:
        self._replay = replay
        self._server_clock = server_clock
        self._clock = clock
        self._max_skew = max_skew
        self._max_age = max_age
        self._on_offset = on_offset

    def checks(self) -> list[tuple[str, ReadinessCheck]]:
        """``clock`` where the replay store has a clock to compare with (Redis)."""
        return [("clock", self.check)] if self._replay.has_clock else []

    def keystore(self) -> Reading | None:
        """This host's clock against the key store's server, from the last announcement's
        reading (None: no such server, none read yet, or too old)."""
        read = self._server_clock()
        if read is None:
            return None
        age = time.monotonic() - read.sent
        if age > STALE:
            return None
        # This host's clock (the one signatures are checked against) when the statement left:
        # now, less the time since on the monotonic clock.
        sent = self._clock() - age
        measured = ClockOffset.measured(sent, read.round_trip, read.server_time)
        self._on_offset("keystore", measured.offset)
        return Reading(read.reference, measured)

    async def check(self) -> tuple[bool, dict[str, Any]]:
        replay = self._replay.latest_clock
        detail: dict[str, Any] = {"reference": REFERENCE, "max_skew_seconds": self._max_skew}
        if replay is None:  # Redis did not answer: the replay_store check says why
            detail["measured"] = False
            return True, detail
        readings = [Reading(REFERENCE, replay)]
        detail.update(
            measured=True,
            offset_seconds=round(replay.offset, 4),
            uncertainty_seconds=round(replay.uncertainty, 4),
        )
        if (other := self.keystore()) is not None:
            readings.append(other)
        detail["references"] = [
            {
                "reference": r.reference,
                "offset_seconds": round(r.measured.offset, 4),
                "uncertainty_seconds": round(r.measured.uncertainty, 4),
            }
            for r in readings
        ]
        verdict = judge(readings, self._max_skew, self._max_age)
        if verdict.reason is not None:
            detail["reason"] = verdict.reason
        if verdict.degraded is not None:
            detail["degraded"] = verdict.degraded
        return verdict.ok, detail
