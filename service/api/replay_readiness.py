"""The replay store's readiness check ``replay_store`` (does it accept requests signed now),
whose probe also measures this host's clock against the store's.

A Redis store sends ``TIME`` in the round trip of its epoch check (service/auth/replay.py), so
the clock costs no round trip of its own and nothing per request; the ``clock`` check, listed
right after (service/api/clock_readiness.py), judges that measurement. With the host or memory
store there is no shared clock to compare with: no ``clock`` check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.api.deps import ReadinessCheck
from service.auth.clock import ClockOffset
from service.auth.replay import ReplayHealth, ReplayStore
from service.auth.setup import AuthParts


class ReplayReadiness:
    """The two checks, and the store's last health for the ``store_up`` gauge's task.
    ``on_offset(store, seconds)``: each measured offset (``cryptd_clock_offset_seconds``)."""

    def __init__(
        self,
        auth: AuthParts,
        *,
        max_skew: int,
        max_age: int,
        on_offset: Callable[[str, float], None],
    ) -> None:
        self._auth = auth
        self._store: ReplayStore = auth.replay
        self._max_skew = max_skew
        self._max_age = max_age
        self._on_offset = on_offset
        self._latest: ReplayHealth | None = None

    def checks(self) -> list[tuple[str, ReadinessCheck]]:
        """For the readiness list (``clock``, service/api/clock_readiness.py, comes right after
        and judges this probe's measurement)."""
        return [("replay_store", self.replay_store)]

    @property
    def has_clock(self) -> bool:
        """Whether the store has a clock to measure this host's against (Redis)."""
        return self._store.backend == "redis"

    @property
    def latest_clock(self) -> ClockOffset | None:
        """This host's clock against the store's, as the last probe measured it."""
        return None if self._latest is None else self._latest.clock

    async def health(self) -> ReplayHealth:
        """Probe the store (and, on Redis, measure the clock against it)."""
        health = await self._store.health()
        self._latest = health
        if health.clock is not None:
            self._on_offset("replay", health.clock.offset)
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
