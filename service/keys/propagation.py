"""Across replicas: how far a key change has reached, said by the answer that made it.

Every replica (one host's server workers, sharing a :class:`~service.keys.board.Board`)
announces ``(replica id, generation)`` on the key store's channel when it puts a newer
keyring generation in force (its board rose), and every :data:`HEARTBEAT` seconds anyway.
So each worker knows the live replicas (heard from within :data:`LIVE` seconds) and the
newest generation each one enforces.

The worker that committed a change first hears its own change's notification on the
channel (notifications reach a listener in commit order, so every announcement committed
before the change has been heard by then: a replica that announced itself and then read the
store either read the change or is waited for). It then waits, at most ``timeout``, until
every live replica has announced that generation or a newer one, or has stopped being live
(its workers' leases ran out before that: service/keys/lease.py), then answers; the answer's
``X-Cryptd-Propagation`` header says how many replicas there were, how many confirmed, how
long the wait took and which replicas did not confirm in time. A confirmation means the whole
replica refuses what the change took away: its board is raised, and none of its workers uses
a key without comparing the board first. A replica that did not confirm within a ``timeout``
shorter than its lease (cut off from the database, overloaded) is named; it enforces the
change once it hears of it (the notification, its periodic store check, or the store read
that regains its lease).

A store without a channel (the keyring file) has one replica per host: the board is the whole
story there, and the header says ``replicas=1, confirmed=1``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from service.keys.board import Board

HEARTBEAT: Final = 2.0  # seconds between a replica's announcements when nothing changes
LIVE: Final = 3 * HEARTBEAT  # a replica not heard from for this long is not waited for
HEADER: Final = "x-cryptd-propagation"


@dataclass(frozen=True, slots=True)
class Propagation:
    """What the answer to a key change reports."""

    replicas: int  # live replicas, this one included
    confirmed: int  # of them, those enforcing the change when the answer left
    waited: float  # seconds the answer waited for them
    missing: tuple[str, ...] = ()  # ids of the live replicas that did not confirm in time

    @property
    def complete(self) -> bool:
        return self.confirmed == self.replicas

    def header(self) -> str:
        """An RFC 8941 dictionary: ``replicas=2, confirmed=2, waited=0.004``."""
        text = f"replicas={self.replicas}, confirmed={self.confirmed}, waited={self.waited:.3f}"
        if self.missing:
            text += ", missing=(" + " ".join(f'"{replica}"' for replica in self.missing) + ")"
        return text


class Replicas:
    """This worker's view of the replicas sharing its key store (loop-bound: call from the
    event loop)."""

    def __init__(
        self,
        board: Board,
        *,
        live_for: float = LIVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` dates the announcements (how long a replica stays live)."""
        self._board = board
        self._live_for = live_for
        self._clock = clock
        self._heard: dict[str, tuple[int, float]] = {}  # replica -> (generation, when)
        self._waiters: set[asyncio.Future[None]] = set()
        self.listening = False  # the channel is read: own changes' notifications are heard
        self._newest_change = 0  # the newest change generation the channel brought

    def changed(self, generation: int) -> None:
        """A change's notification arrived (this worker's own ones included)."""
        if generation > self._newest_change:
            self._newest_change = generation
            self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def me(self) -> str:
        return self._board.replica

    def heard(self, replica: str, generation: int) -> None:
        """An announcement arrived: ``replica`` enforces ``generation``."""
        if replica == self.me:
            return
        known = self._heard.get(replica)
        newest = generation if known is None else max(known[0], generation)
        self._heard[replica] = (newest, self._clock())
        self._wake()

    def live(self) -> dict[str, int]:
        """The other replicas heard from within the live window, and their generations."""
        horizon = self._clock() - self._live_for
        for replica in [r for r, (_, when) in self._heard.items() if when < horizon]:
            del self._heard[replica]
        return {replica: generation for replica, (generation, _) in self._heard.items()}

    def behind(self, generation: int) -> list[str]:
        """The live replicas that have not announced ``generation`` (or a newer one)."""
        return sorted(r for r, g in self.live().items() if g < generation)

    def _forgotten_in(self, replicas: list[str]) -> float:
        """Seconds until the first of ``replicas`` stops being live (if none announces)."""
        now = self._clock()
        return min(self._heard[r][1] + self._live_for - now for r in replicas)

    async def confirm(self, generation: int, timeout: float) -> Propagation:  # noqa: ASYNC109
        """Wait until this worker has heard its change's notification and every live replica
        enforces ``generation`` or is no longer live, or ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout

        def pending() -> list[str] | None:
            if self.listening and self._newest_change < generation:
                return None  # not heard yet: announcements before it may be on their way
            return self.behind(generation)

        while (missing := pending()) != [] and (remaining := deadline - loop.time()) > 0:
            if missing:
                remaining = min(remaining, max(self._forgotten_in(missing), 0.001))
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)
        if missing is None:  # the notification never came: every live replica is in doubt
            missing = sorted(self.live())
        replicas = 1 + len(self.live())
        return Propagation(
            replicas=replicas,
            confirmed=replicas - len(missing),
            waited=loop.time() - started,
            missing=tuple(missing),
        )
