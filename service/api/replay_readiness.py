"""The replay store's readiness checks: ``replay_store`` (does it accept requests signed now)
and, on Redis, ``clock`` (does this host's clock let correctly signed requests through).

One probe of the store answers both: a Redis store sends ``TIME`` in the round trip of its
epoch check (service/auth/replay.py), so the clock costs no round trip of its own and nothing
per request. ``replay_store`` probes; ``clock``, listed right after it, judges that probe's
measurement (service/auth/clock.py). A host whose clock is behind by more than the maximum skew
refuses every correctly signed request (401 ``future``): it is not ready, so the balancer sends
them elsewhere. Ahead by more than the skew it still serves correctly (the store's clock bounds
a request's age) and says so as degraded. With the host or memory store there is no shared
clock to compare with: no ``clock`` check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.api.deps import ReadinessCheck
from service.auth.clock import REFERENCE, judge
from service.auth.replay import ReplayHealth, ReplayStore
from service.auth.setup import AuthParts


class ReplayReadiness:
    """The two checks, and the store's last health for the ``store_up`` gauge's task.
    ``on_offset(seconds)``: each measured offset (the ``cryptd_clock_offset_seconds`` gauge)."""

    def __init__(
        self,
        auth: AuthParts,
        *,
        max_skew: int,
        max_age: int,
        on_offset: Callable[[float], None],
    ) -> None:
        self._auth = auth
        self._store: ReplayStore = auth.replay
        self._max_skew = max_skew
        self._max_age = max_age
        self._on_offset = on_offset
        self._latest: ReplayHealth | None = None

    def checks(self) -> list[tuple[str, ReadinessCheck]]:
        """For the readiness list, in this order (``clock`` judges ``replay_store``'s probe)."""
        checks: list[tuple[str, ReadinessCheck]] = [("replay_store", self.replay_store)]
        if self._store.backend == "redis":
            checks.append(("clock", self.clock))
        return checks

    async def health(self) -> ReplayHealth:
        """Probe the store (and, on Redis, measure the clock against it)."""
        health = await self._store.health()
        self._latest = health
        if health.clock is not None:
            self._on_offset(health.clock.offset)
        return health

    async def replay_store(self) -> tuple[bool, dict[str, Any]]:
        health = await self.health()
        detail: dict[str, Any] = {"backend": self._store.backend}
        target = self._auth.redis_target
        if target is not None and target.mode != "standalone":
            detail["redis"] = target.describe()  # Sentinels or Cluster seeds
        if health.reason is not None:
            detail["reason"] = health.reason
        if health.retry_after is not None:
            detail["retry_after"] = health.retry_after
        if health.degraded is not None:
            detail["degraded"] = health.degraded
        return health.ok, detail

    async def clock(self) -> tuple[bool, dict[str, Any]]:
        measured = None if self._latest is None else self._latest.clock
        detail: dict[str, Any] = {"reference": REFERENCE, "max_skew_seconds": self._max_skew}
        if measured is None:  # Redis did not answer: the replay_store check says why
            detail["measured"] = False
            return True, detail
        verdict = judge(measured, self._max_skew, self._max_age)
        detail.update(
            measured=True,
            offset_seconds=round(measured.offset, 4),
            uncertainty_seconds=round(measured.uncertainty, 4),
        )
        if verdict.reason is not None:
            detail["reason"] = verdict.reason
        if verdict.degraded is not None:
            detail["degraded"] = verdict.degraded
        return verdict.ok, detail
