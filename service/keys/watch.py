"""Keeps a server worker's keyring current: push notifications where the store has them, a
periodic check as the backstop, a check before any "not found", and a store read before
serving whenever this host's board (service/keys/board.py) is ahead of the snapshot.

A request naming a key or version this worker does not know waits for one store check that
started after it arrived, then looks again: a key created through another worker or replica
is found, never answered 404. Checks after misses start at most every ``miss_interval`` and
concurrent misses share one, so a stream of unknown names costs the store a few small reads a
second, not one per request.

With a store shared by replicas, a worker serves from memory only while it holds its lease
(service/keys/lease.py): every announcement that reaches the store extends it; one after it
ran out is followed by a store check before the lease is held again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from service.errors import KeystoreUnavailable
from service.keys.keyring import Keyring
from service.keys.lease import LEASE, Lease
from service.keys.manager import KeyManager
from service.keys.propagation import HEARTBEAT, Replicas
from service.keys.store import Announced, Notice

log = logging.getLogger("cryptd.keyring")

MISS_INTERVAL = 0.05  # seconds between store checks triggered by unknown keys or versions
# While the lease is out, requests start at most one attempt to regain it this often (the
# others answer 503 at once): a store that is down is not asked once per request.
REGAIN_INTERVAL = 0.25
REGAIN_WAIT = 1.0  # seconds a request waits for such an attempt before it is answered 503


class KeyringWatcher:
    def __init__(
        self,
        manager: KeyManager,
        *,
        interval: float,
        miss_interval: float = MISS_INTERVAL,
        run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
        replicas: Replicas | None = None,
        heartbeat: float = HEARTBEAT,
        lease: float = LEASE,
    ) -> None:
        """``replicas`` hears the other replicas' announcements (a store with a channel); this
        worker announces its host's generation after every change it hears of and every
        ``heartbeat`` seconds; ``lease``: how long after one of its announcements it serves."""
        self._manager = manager
        self._board = manager.board.cell
        self.replicas = replicas if replicas is not None else Replicas(manager.board)
        self._heartbeat = heartbeat
        self._interval = interval
        self._miss_interval = miss_interval
        self._run_blocking = run_blocking or asyncio.to_thread
        self._task: asyncio.Future[Any] | None = None
        self._task_started = float("-inf")  # when the check in flight (or the last) started
        self._completed_started = float("-inf")  # start of the newest finished check
        self._tasks: list[asyncio.Task[None]] = []
        self._following: set[asyncio.Task[None]] = set()  # changes being loaded, announced
        # Held for good unless start() finds a channel (other replicas to keep in step with).
        self.lease = Lease(lease)
        self._regaining: asyncio.Future[bool] | None = None
        self._next_regain = float("-inf")

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._backstop()))
        if (stream := self._manager.store.notifications()) is not None:
            self.lease.require()
            self.replicas.listening = True
            # Changes up to the one loaded at start were notified before this worker listened.
            self.replicas.changed(self._manager.keyring.generation)
            self._tasks.append(asyncio.create_task(self._listen(stream)))
            self._tasks.append(asyncio.create_task(self._announce_every()))

    async def current(self) -> Keyring:
        """The snapshot to serve: the one in memory, unless the board says a newer generation
        is in force on this host, or the lease ran out; then once the store has been read
        (503 ``keystore_unavailable`` if that did not bring it)."""
        keyring = self._manager.keyring
        enforced = int(self._board[0])  # what this request must see; later changes need not
        if not self.lease.held:
            await self._regain()
            keyring = self._manager.keyring
        if enforced <= keyring.generation:
            return keyring
        # Any check that brings a verified snapshot as new as the board will do, the one in
        # flight included (the notification of the change that raised the board usually
        # started it just before this request): a check started after the request is waited
        # for only when that one did not bring it. Waiting for a fresh check every time made
        # the first request after a sibling's change wait for two full store reads.
        await self._check(self.now(), rate_limited=True, enough=self._loaded(enforced))
        return self._manager.caught_up(enforced)

    def lease_lapsed(self) -> str | None:
        """Why keys are not served now (the lease ran out), or None."""
        if self.lease.held:
            return None
        why = self._manager.store_error
        return (
            "the key store has not been reached in time: keys are not served until it is, "
            "since a change made meanwhile on another replica may not be in force here"
            + (f" ({why})" if why else "")
        )

    async def regain(self) -> str | None:
        """Try to regain a lease that ran out (readiness asks); why keys are not served, or
        None when they are."""
        if self.lease.held:
            return None
        with contextlib.suppress(KeystoreUnavailable):
            await self._regain()
        return self.lease_lapsed()

    async def _regain(self) -> None:
        """Announce this host and read the store (one attempt shared by the requests that
        arrive meanwhile, at most one per :data:`REGAIN_INTERVAL`, waited for at most
        :data:`REGAIN_WAIT`); 503 while the lease is still out."""
        attempt = self._regaining
        if attempt is None and self.now() >= self._next_regain:
            self._next_regain = self.now() + REGAIN_INTERVAL
            attempt = self._regaining = asyncio.ensure_future(self.announce())

            def over(_: asyncio.Future[bool]) -> None:
                self._regaining = None

            attempt.add_done_callback(over)
        if attempt is not None:
            # Not for longer than a moment: over a dead link the attempt lasts until the
            # connection's timeouts (seconds); the request is answered 503 meanwhile.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(attempt), REGAIN_WAIT)
        if not self.lease.held:
            raise KeystoreUnavailable(
                f"{self.lease_lapsed()}; nothing was served. Retry in a moment, or on another "
                "replica"
            )

    async def close(self) -> None:
        self.lease.close()
        tasks = [*self._tasks, *self._following]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._following.clear()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    async def after_miss(self, since: float) -> None:
        """Return once a store check that started at or after loop time ``since`` is done.

        A name or version this worker does not know may exist in the store: only a check that
        read and verified the store can say it does not. While the store cannot be read (a
        failover, a promotion) or its content is refused, raise 503 ``keystore_unavailable``
        (with Retry-After) instead of letting the caller answer 404 for a key that exists; at
        once when the store is already known to be unreachable (a miss must not wait for a
        connection timeout: the periodic check reconnects)."""
        if self._manager.store_unreachable is None:
            await self._check(since, rate_limited=True)
        why = self._manager.store_error
        if why is not None:
            raise KeystoreUnavailable(
                "the key store cannot be read now, so this worker cannot tell whether the key "
                "or version exists (it is not in the keyring in memory); retry in a moment "
                f"({why})"
            )

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def refresh(self, generation: int | None = None) -> None:
        """Check the store now (a notification arrived). With the ``generation`` the
        notification names, a check already under way that brings it (or a newer one) is
        enough: the store is not read a second time for the same change."""
        enough = None if generation is None else self._loaded(generation)
        await self._check(self.now(), rate_limited=False, enough=enough)

    def _loaded(self, generation: int) -> Callable[[], bool]:
        """Whether the snapshot in memory has reached ``generation`` (asked after each check)."""
        return lambda: self._manager.keyring.generation >= generation

    async def announce(self) -> bool:
        """Tell the other replicas which generation this host enforces, and extend the lease
        (never raises; False when the announcement did not reach the store)."""
        board = self._manager.board
        started = self.now()
        try:
            await self._run_blocking(
                lambda: self._manager.store.announce(board.replica, board.generation)
            )
        except Exception as exc:  # the heartbeat says it again shortly
            log.warning("keyring announcement failed", extra={"error_type": type(exc).__name__})
            return False
        if self.lease.holds_at(self.now()):
            # Held all along, until the announcement had committed: every change committed
            # meanwhile was waited for by its committer until this host enforced it (a
            # committer forgets the host only after its lease would have run out).
            self.lease.extend(started)
        else:
            # Back after the lease ran out (or just started): changes committed meanwhile did
            # not wait for this host. The others hear it from now on (the announcement
            # committed); a check started now brings what they committed before.
            await self._check(self.now(), rate_limited=False)
            if self._manager.store_error is None:
                self.lease.extend(started)
        return True

    async def _check(
        self, since: float, *, rate_limited: bool, enough: Callable[[], bool] | None = None
    ) -> None:
        """Return once a check that started at or after ``since`` is done, or as soon as
        ``enough()`` holds after a check finished."""
        loop = asyncio.get_running_loop()
        while self._completed_started < since and not (enough is not None and enough()):
            task = self._task
            if task is None:
                wait = self._task_started + self._miss_interval - loop.time()
                if rate_limited and wait > 0:
                    await asyncio.sleep(wait)
                    continue
                task = self._start(loop.time())
            started = self._task_started
            with contextlib.suppress(Exception):  # refresh() never raises; a dead executor may
                await asyncio.shield(task)
            # Awaiting a check that is already done returns without yielding to the loop, so
            # its done callback may not have run yet: settle it here, or this loop would spin
            # forever on a finished check and block the worker.
            self._settle(task, started)

    def _settle(self, task: asyncio.Future[Any], started: float) -> None:
        """Record a finished check (idempotent: its callback and its waiters both call it)."""
        if self._task is task:
            self._task = None
        self._completed_started = max(self._completed_started, started)

    def _start(self, started: float) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(self._run_blocking(self._manager.refresh))
        self._task, self._task_started = task, started

        def done(finished: asyncio.Future[Any]) -> None:
            self._settle(finished, started)
            if not finished.cancelled() and finished.exception() is not None:
                log.error(
                    "keyring check failed",
                    extra={"error_type": type(finished.exception()).__name__},
                )

        task.add_done_callback(done)
        return task

    async def _backstop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._check(self.now(), rate_limited=False)
            except Exception as exc:  # refresh never raises; this is the last guard
                log.error("keyring check failed", extra={"error_type": type(exc).__name__})

    async def _listen(self, stream: AsyncGenerator[Notice, None]) -> None:
        """Read the notifications as they come. A change is loaded and announced in a task of
        its own: the next notification, another replica's announcement above all, is never
        read only after a store check. (Awaiting the check here held the announcements a
        committing worker's answer waits for behind the check its own change's notification
        started: a whole store read, hundreds of milliseconds under load.)"""
        try:
            async for notice in stream:
                if isinstance(notice, Announced):
                    self.replicas.heard(notice.replica, notice.generation)
                    continue
                if notice.generation is not None:
                    self.replicas.changed(notice.generation)
                self._manager.heard(notice)  # which keys to read, before the check reads
                task = asyncio.create_task(self._follow(notice.generation))
                self._following.add(task)
                task.add_done_callback(self._following.discard)
        finally:
            await stream.aclose()  # closes the listening connection when cancelled

    async def _follow(self, generation: int | None) -> None:
        """Load the change a notification named, then say so to the other replicas."""
        try:
            await self.refresh(generation)
        except Exception as exc:
            log.error("keyring check failed", extra={"error_type": type(exc).__name__})
        # The refresh raised the board (or a sibling's did): the whole host enforces the
        # change now; the replica that made it is waiting to hear so.
        await self.announce()

    async def _announce_every(self) -> None:
        while True:
            await self.announce()
            await asyncio.sleep(self._heartbeat)
