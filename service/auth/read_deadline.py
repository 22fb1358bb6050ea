"""A read timeout that does not count the event loop's own stalls against the server.

redis-py times a read with ``asyncio.timeout(socket_timeout)``. When the event loop itself is
held up past that timeout (a long synchronous step of another request, a pause of the whole
process) while Redis's answer is on its way, both become due in the same loop pass: the
socket's data is handed over first, but the timer's cancellation reaches the reading task
before it can run, and a reply already in this process's socket buffer ends as a timeout (503
"replay store unavailable"). Here the timer checks how late it runs: late past
:data:`STALL_SLACK`, the loop, not Redis, held things up, and the read gets one more period,
counted from then, to take what has arrived. Only once: a Redis that is gone still costs at
most two periods plus the stall.

Used for every Redis read cryptd makes (a serial connection's batch, and any read redis-py
times with the socket timeout on the connections of service/auth/redis_client.py) and for
their connects: a connection accepted while the loop stalled is used, not a timeout either.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Final, Self

# A timer that runs this much after its time was held up by the loop (a timer of an idle
# loop runs within a millisecond or so).
STALL_SLACK: Final = 0.05


class ReadDeadline:
    """``async with ReadDeadline(timeout):`` raises TimeoutError out of the block after
    ``timeout`` seconds of waiting, extended once by ``timeout`` when its timer ran late."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._extended = False
        self._guard = asyncio.timeout(None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    @property
    def extended(self) -> bool:
        """Whether the timer ran late and gave the read a second period."""
        return self._extended

    async def __aenter__(self) -> Self:
        await self._guard.__aenter__()
        self._loop = asyncio.get_running_loop()
        self._arm(self._loop.time())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._guard.__aexit__(exc_type, exc, tb)

    def _arm(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self._timeout
        self._handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        if now - self._due > STALL_SLACK and not self._extended:
            # The answer may be in the socket already; its data callback ran in this pass,
            # the reading task runs in the next one.
            self._extended = True
            self._arm(now)
            return
        self._guard.reschedule(now)  # expires now: the block is cancelled, TimeoutError
