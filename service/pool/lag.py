"""Event-loop lag: how late the loop runs a timer, i.e. how long new work waits for it.

Work placed inline (AES-GCM, one EC, Ed25519, RSA-2048 or SM2 item) has no queue of its own
for the executors' bound to act on: when it arrives faster than one core can do it, requests
wait for the event loop instead. A timer is kept pending every ``interval``; how far past its
due time the loop is *now* is the lag, so a request handled deep inside one long loop iteration
(a burst read at once) sees it as well as one handled later. Above ``limit`` the crypto routes
answer 503 ``overloaded`` at once, before any cryptography (service/api/pipeline.py), so
accepted requests keep their latency and clients back off.
"""

from __future__ import annotations

import asyncio
import contextlib


class LoopLag:
    def __init__(self, limit: float, *, interval: float = 0.01) -> None:
        """``limit``: lag in seconds beyond which :attr:`overloaded` is true."""
        if limit <= 0 or interval <= 0:
            raise ValueError("limit and interval must be positive")
        self.limit = limit
        self.interval = interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = float("inf")  # when the pending timer should fire (loop time)
        self._task: asyncio.Task[None] | None = None

    @property
    def lag(self) -> float:
        """Seconds the loop is behind its pending timer now (0 when on time or not started)."""
        if self._loop is None:
            return 0.0
        return max(0.0, self._loop.time() - self._due)

    @property
    def overloaded(self) -> bool:
        return self.lag > self.limit

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._tick())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._loop = None

    async def _tick(self) -> None:
        assert self._loop is not None
        while True:
            self._due = self._loop.time() + self.interval
            await asyncio.sleep(self.interval)
