"""How long a server worker may serve its keyring from memory while it cannot hear the key
store: its lease.

Why: a replica that committed a change waits, before answering, for every *live* replica
(heard from within :data:`~service.keys.propagation.LIVE` seconds) to enforce it; one it has
not heard from for longer is not waited for. A replica cut off from the store (a network
partition, a lost link) keeps its keyring in memory, and would go on serving a key that was
disabled or deleted elsewhere meanwhile, or do so for a moment after its link returned, before
its next store check. So a worker serves from memory only while the others still count its
host as live: its lease runs :data:`LEASE` seconds from the start of its last announcement
that reached the store (less than ``LIVE``, so it has run out before the others stop waiting
for the host). When it has run out, the worker announces itself and reads the store (a check
started after the announcement) before it serves again; until that succeeds, requests that
use a key answer 503 ``keystore_unavailable`` and /readyz is not ready.

The price, chosen deliberately: while no replica can reach the store, crypto stops
:data:`LEASE` seconds after the store went away, as Vault's active node stops serving when it
loses its storage lock. A store without a channel (the keyring file, one replica per host)
needs no lease: the host's board is the whole story there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from service.keys.propagation import HEARTBEAT, LIVE

log = logging.getLogger("cryptd.keyring")

# From an announcement's start until the lease runs out: two heartbeats may fail without a
# refusal, and the lease is over a second before the others forget the host.
LEASE: Final = LIVE - HEARTBEAT / 2


class Lease:
    """One worker's lease (loop-bound). ``held`` is read on the hot path: a plain attribute,
    turned off by a timer when the lease runs out."""

    __slots__ = ("_duration", "_timer", "_until", "held")

    def __init__(self, duration: float = LEASE) -> None:
        """Held for good until :meth:`require` (a store without other replicas needs none)."""
        self.held = True
        self._duration = duration
        self._until = float("inf")  # loop time
        self._timer: asyncio.TimerHandle | None = None

    def require(self) -> None:
        """The store has other replicas to keep in step with: not held until extended."""
        self.held = False
        self._until = float("-inf")

    def holds_at(self, when: float) -> bool:
        """Whether the lease was (or will be) held at loop time ``when``."""
        return when < self._until

    @property
    def until(self) -> float:
        return self._until

    def extend(self, announced: float) -> None:
        """An announcement that started at loop time ``announced`` reached the store."""
        until = announced + self._duration
        if until <= self._until:
            return
        self._until = until
        self.held = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(until, self._run_out)

    def _run_out(self) -> None:
        self._timer = None
        self.held = False
        log.warning(
            "keyring lease ran out: the key store was not reached in time; keys are not served "
            "until it is (a change made elsewhere meanwhile may not be in force here)",
            extra={"lease_s": self._duration},
        )

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
