"""Replay protection: remember each ``(keyid, nonce)`` for as long as its signature is valid.

:class:`MemoryReplayStore` serves one process; :class:`RedisReplayStore` lets replicas (and
server worker processes) share what they have seen; :class:`~service.auth.replay_host.
HostReplayStore` lets the worker processes of one host share it without a server. Only
authenticated requests reach a store, so an attacker cannot fill it with nonces of requests
it could not sign.

One job (over 400 lines): the replay-store interface and its memory and Redis stores, which
share the epoch rule below and the primary-identity check that a failover must not bypass;
the Redis connection itself is in redis_client.py, the host store in replay_host.py.

A store that starts empty while requests were accepted before it existed (Redis restarted, a
new host store) cannot tell those requests' replays from fresh ones. Redis and the host store
therefore keep an *epoch*, the time they started, and refuse every request created before
``epoch + max_skew`` (:class:`StoreRecovering`): a request accepted earlier was created at
most ``max_skew`` seconds ahead of its acceptance, so none of them is accepted again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from service.auth.clock import ClockOffset
from service.auth.coalesce import Coalescer
from service.auth.redis_client import REDIS_ERRORS, Command, RedisClient, sender
from service.auth.signature import DEFAULT_MAX_AGE, DEFAULT_MAX_SKEW

KEY_PREFIX: Final = "cryptd:nonce:"
DEFAULT_MAX_ENTRIES: Final = 1_000_000


class StoreUnavailable(Exception):
    """The store cannot answer (Redis down or too slow, store full)."""


class TooOld(Exception):
    """The shared store's clock says the request is older than the maximum age, whatever the
    replica's own clock said (401 stale: a replica whose clock is behind must not accept what
    the others already refuse, as the nonce may be gone)."""


class StoreRecovering(StoreUnavailable):
    """The store started after the request was created: it could be the replay of a request
    accepted before the store existed, so the store cannot vouch for it (503, never
    fail-open). ``retry_after``: seconds until a request signed anew is past the epoch."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"request created before the replay store's epoch ({retry_after} s)")
        self.retry_after = min(max(1, retry_after), 3600)


@dataclasses.dataclass(frozen=True)
class ReplayHealth:
    """What readiness says of the store: ``ok`` (it accepts requests signed now), a
    ``reason`` when it does not, ``degraded`` when it serves without a safety margin (a
    Sentinel-managed primary with no replica left); ``clock``: this host's clock against the
    store's, measured by the same probe (a Redis store that answered; None otherwise)."""

    ok: bool
    reason: str | None = None
    degraded: str | None = None
    retry_after: int | None = None  # seconds until the refusal window ends
    clock: ClockOffset | None = None


class ReplayStore(Protocol):
    backend: str  # "memory", "host" or "redis" (readiness)

    def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> Awaitable[bool]:
        """To await: record the pair for ``ttl`` seconds. True the first time, False for a
        replay (a coroutine, or a future the store resolves).

        ``created`` is the request's signature time. Raises :class:`StoreUnavailable` when
        the store cannot tell, :class:`StoreRecovering` when ``created`` precedes its epoch.
        """
        ...

    async def ping(self) -> bool:
        """Whether the store answers and accepts requests signed now (readiness)."""
        ...

    async def health(self) -> ReplayHealth:
        """:meth:`ping` with the reason when not (and whether it serves degraded)."""
        ...

    async def aclose(self) -> None:
        """Release connections (shutdown)."""
        ...


class MemoryReplayStore:
    """In-process store: key -> expiry second, plus one bucket of keys per expiry second.

    Purging walks whole buckets in time order (a heap of a few hundred seconds, not of every
    entry), so an entry costs one dict slot and one list slot beside its key. Expiry is
    rounded up to the next second: a nonce may be kept up to a second longer, never shorter.
    Memory is bounded: beyond ``max_entries`` live entries the store refuses
    (StoreUnavailable) rather than forget a nonce early. It has no epoch: it lives and dies
    with its process, which is the only one accepting requests with it.
    """

    backend = "memory"

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._expiry: dict[str, int] = {}
        self._buckets: dict[int, list[str]] = {}
        self._seconds: list[int] = []  # heap of the buckets' expiry seconds

    async def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> bool:
        return self.remember_now(keyid, nonce, ttl, time.monotonic())

    def remember_now(self, keyid: str, nonce: str, ttl: int, now: float) -> bool:
        self._purge(now)
        key = f"{keyid}:{nonce}"  # a client id holds no ':'
        if key in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise StoreUnavailable("replay store full")
        expires = math.ceil(now + ttl)
        self._expiry[key] = expires
        bucket = self._buckets.get(expires)
        if bucket is None:
            bucket = self._buckets[expires] = []
            heapq.heappush(self._seconds, expires)
        bucket.append(key)
        return True

    def _purge(self, now: float) -> None:
        seconds, expiry = self._seconds, self._expiry
        while seconds and seconds[0] <= now:
            second = heapq.heappop(seconds)
            for key in self._buckets.pop(second):
                if expiry.get(key) == second:
                    del expiry[key]

    def __len__(self) -> int:
        return len(self._expiry)

    async def ping(self) -> bool:
        return True

    async def health(self) -> ReplayHealth:
        return ReplayHealth(True)

    async def aclose(self) -> None:
        return None


# The identity of the Redis that runs the script: its run id (new at every start) and its
# replication id (new when a replica is promoted). Both appear in INFO, readable from a script,
# so the check is atomic with the nonces it guards. A server whose INFO lacks them (a
# Redis-like service hiding them) is refused, never trusted with an identity that cannot change.
_IDENTITY_LUA: Final = """
local server = redis.call('INFO', 'server')
local replication = redis.call('INFO', 'replication')
local run = string.match(server, 'run_id:(%w+)')
local replid = string.match(replication, 'master_replid:(%w+)')
if not run or not replid then
  return redis.error_reply('ERR cryptd: INFO shows no run_id or master_replid')
end
local identity = run .. ':' .. replid
local replicas = tonumber(string.match(replication, 'connected_slaves:(%d+)')) or 0
"""
# KEYS[1]: the epoch key; KEYS[2]: the identity of the Redis that set it; KEYS[3..]: nonce
# keys. ARGV[1]: the maximum skew (s); ARGV[2]: the maximum age (s); then, per nonce key, its
# TTL and its request's created time. Returns {seconds until the refusal window ends (<= 0:
# over), connected replicas, then per nonce: 1 the first time, 0 for a replay, 2 for a request
# older than the maximum age by Redis's clock (refused), -n for a request created n seconds
# before epoch + skew (refused)}. The epoch is Redis's clock, rounded up, taken again whenever
# the Redis answering is not the one that set it: a restart (even one that reloaded a snapshot
# with the epoch in it) or a promoted replica (which may lack the last nonces its old primary
# accepted) refuses what was signed before, as a store with no epoch at all does.
#
# The age is checked again here, on the one clock every replica shares, and a nonce is kept
# until that clock would refuse its request (or for the TTL the replica asked, if longer):
# replicas whose clocks disagree cannot accept a replay. Otherwise a replica whose clock is
# ahead stores a nonce for too short a time, and one whose clock is behind still accepts the
# request after the nonce has expired (measured on the test bed with a host 10 s behind).
_SET_MANY_SCRIPT: Final = (
    _IDENTITY_LUA
    + """
local now = tonumber(redis.call('TIME')[1])
local epoch = tonumber(redis.call('GET', KEYS[1]))
if epoch == nil or redis.call('GET', KEYS[2]) ~= identity then
  if epoch == nil or epoch < now + 1 then
    epoch = now + 1
    redis.call('SET', KEYS[1], tostring(epoch))
  end
  redis.call('SET', KEYS[2], identity)
end
local floor = epoch + tonumber(ARGV[1])
local max_age = tonumber(ARGV[2])
local out = {floor - now, replicas}
for i = 3, #KEYS do
  local created = tonumber(ARGV[2 * i - 2])
  local ttl = math.max(tonumber(ARGV[2 * i - 3]), created + max_age + 1 - now)
  if created < floor then
    out[i] = created - floor
  elseif created + max_age < now then
    out[i] = 2
  elseif redis.call('SET', KEYS[i], '1', 'NX', 'EX', ttl) then
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)
# Redis names scripts by their SHA-1 (an identifier, not a security function).
_SET_MANY_SHA: Final = hashlib.sha1(_SET_MANY_SCRIPT.encode(), usedforsecurity=False).hexdigest()
# Records the Redis answering now as the one whose epoch is ``ARGV[1]`` (unless an epoch is
# set): for a Redis that has never accepted a request, so there is nothing to wait for (tests,
# a deployment's first start with clients created with the store).
SEED_SCRIPT: Final = (
    _IDENTITY_LUA
    + """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('SET', KEYS[2], identity)
return 1
"""
)

# Redis Cluster runs a script only over keys of one slot. Nonces are spread over PARTITIONS
# hash tags, each with its own epoch and identity keys, chosen so that the tags' slots are
# evenly spaced over the 16,384: every shard gets its share whatever its slot range. A nonce's
# partition is a hash of its client id and nonce, so a replay meets its original.
PARTITIONS: Final = 64
HASH_SLOTS: Final = 16384


def partition_tags(count: int) -> tuple[str, ...]:
    tags = []
    width = HASH_SLOTS // count
    candidate = 0
    for index in range(count):
        while True:
            tag = f"p{candidate}"
            candidate += 1
            slot = key_slot(tag.encode())
            if index * width <= slot < (index + 1) * width:
                tags.append(tag)
                candidate = 0
                break
    return tuple(tags)


class RedisReplayStore:
    """Shared store: ``SET cryptd:nonce:<keyid>:<nonce> 1 NX EX ttl`` is atomic across replicas.

    Pass a client built by :func:`service.auth.redis_client.connect` (short timeouts, one quick
    retry): a dead Redis then costs milliseconds per request, not seconds, and redis-py
    reconnects by itself when it returns (through the Sentinels, to whichever primary they
    name). The nonces of concurrent requests go to Redis together: one Lua script runs the SETs
    of a whole batch (:mod:`service.auth.coalesce`), ~7 us of CPU per nonce instead of ~100
    us. The same script keeps the epoch (``<prefix>epoch``) and the identity of the Redis that
    set it (``<prefix>primary``), so every batch is checked against the epoch of the Redis
    that stores it. On Redis Cluster the keys carry a hash tag (``<prefix>{pN}:...``, one of
    :data:`PARTITIONS`): a batch is split by tag and each part runs on its own slot.
    """

    backend = "redis"

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = KEY_PREFIX,
        max_skew: int = DEFAULT_MAX_SKEW,
        max_age: int = DEFAULT_MAX_AGE,
        sentinel: bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: the one request signatures are checked against on this host, measured
        against Redis's at every :meth:`establish` (service/auth/clock.py)."""
        self._redis = client
        self._clock = clock
        self._max_age = max_age
        self._connection = sender(client)
        self._prefix = prefix
        self._cluster = isinstance(client, RedisCluster)
        # Sentinel: a primary that lost its replica still serves, but says so (degraded).
        self._sentinel = (
            isinstance(client, Redis) and isinstance(client.connection_pool, SentinelConnectionPool)
            if sentinel is None
            else sentinel
        )
        # No client id is "epoch" or "primary" followed by nothing: nonce keys always have a
        # second ':'.
        self._tags: tuple[str, ...] = partition_tags(PARTITIONS) if self._cluster else ("",)
        self._max_skew = max_skew
        self._coalescer: Coalescer[tuple[str, int, int], int | Exception] = Coalescer(
            self._set_many
        )

    def _base(self, tag: str) -> str:
        return f"{self._prefix}{{{tag}}}:" if tag else self._prefix

    async def remember(self, keyid: str, nonce: str, created: int, ttl: int) -> bool:
        # keyid is a client id ([A-Za-z0-9_.-], no ':'), so the key is unambiguous.
        pair = f"{keyid}:{nonce}"
        tag = self._tags[zlib.crc32(pair.encode()) % len(self._tags)] if self._cluster else ""
        try:
            verdict = await self._coalescer.submit((self._base(tag) + pair, max(1, ttl), created))
        except REDIS_ERRORS as exc:
            # Connection refused or lost, timeout, READONLY during a failover, OOM, ...
            raise StoreUnavailable(type(exc).__name__) from exc
        if isinstance(verdict, Exception):  # this nonce's shard alone could not answer
            raise StoreUnavailable(type(verdict).__name__) from verdict
        if verdict < 0:
            raise StoreRecovering(-verdict)
        if verdict == 2:
            raise TooOld()
        return bool(verdict)

    def _tag_of(self, key: str) -> str:
        if not self._cluster:
            return ""
        return key[len(self._prefix) + 1 : key.index("}", len(self._prefix))]

    async def _set_many(self, items: Sequence[tuple[str, int, int]]) -> list[int | Exception]:
        groups: dict[str, list[int]] = {}
        for index, (key, _, _) in enumerate(items):
            groups.setdefault(self._tag_of(key), []).append(index)
        tags = list(groups)
        replies = await self._run([[items[i] for i in groups[tag]] for tag in tags], tags)
        verdicts: list[int | Exception] = [0] * len(items)
        for tag, reply in zip(tags, replies, strict=True):
            for position, index in enumerate(groups[tag]):
                # On a Cluster, a shard that fails refuses its own nonces, not the batch's.
                verdicts[index] = (
                    reply if isinstance(reply, Exception) else int(reply[2 + position])
                )
        return verdicts

    async def _run(
        self,
        batches: Sequence[Sequence[tuple[str, int, int]]],
        tags: Sequence[str],
        extra: Sequence[Command] = (),
    ) -> list[list[Any] | Exception]:
        """One script call per tag (one call in all but on a Cluster), in one round trip;
        a call's error reply comes back in its place (a lost connection to a single Redis is
        raised). ``extra`` commands go in the same round trip, their replies after the
        scripts'."""
        commands = []
        for batch, tag in zip(batches, tags, strict=True):
            base = self._base(tag)
            keys = [f"{base}epoch", f"{base}primary", *(key for key, _, _ in batch)]
            args = [
                self._max_skew,
                self._max_age,
                *(v for _, ttl, created in batch for v in (ttl, created)),
            ]
            commands.append((len(keys), *keys, *args))
        calls: list[Command] = [("EVALSHA", _SET_MANY_SHA, *command) for command in commands]
        if extra:
            calls += extra
        replies = await self._connection.pipeline(calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:  # Redis restarted or flushed its scripts: send the script itself
            again = await self._connection.pipeline(
                [("EVAL", _SET_MANY_SCRIPT, *commands[i]) for i in missing]
            )
            for index, reply in zip(missing, again, strict=True):
                replies[index] = reply
        return [reply if isinstance(reply, Exception) else list(reply) for reply in replies]

    async def establish(self) -> ReplayHealth:
        """Set the epoch now if the Redis answering has none (at start, and at every readiness
        probe), and say whether requests signed now are accepted. Raises what the Redis client
        raises when it cannot answer. Redis's ``TIME`` goes in the same round trip: the health
        says how far this host's clock is from Redis's (service/auth/clock.py)."""
        sent = self._clock()
        start = time.monotonic()
        *scripts, now = await self._run([[] for _ in self._tags], self._tags, _TIME)
        clock = _offset(now, sent, time.monotonic() - start)
        replies = []
        for reply in scripts:
            if isinstance(reply, Exception):
                raise reply
            replies.append(reply)
        remaining = max(int(reply[0]) for reply in replies)
        replicas = min(int(reply[1]) for reply in replies)
        degraded = None
        if self._sentinel and replicas == 0:
            degraded = "the Redis primary has no replica: losing it now loses the nonces"
        if remaining > 0:
            return ReplayHealth(
                False,
                f"replay store: a new Redis primary (start, restart or failover) refuses "
                f"requests signed before its epoch for {remaining} s more",
                degraded,
                remaining,
                clock,
            )
        return ReplayHealth(True, None, degraded, None, clock)

    async def health(self) -> ReplayHealth:
        try:
            return await self.establish()
        except REDIS_ERRORS as exc:
            return ReplayHealth(False, f"replay store: Redis unreachable ({_describe(exc)})")

    async def ping(self) -> bool:
        return (await self.health()).ok

    async def aclose(self) -> None:
        await self._connection.aclose()


_TIME: Final[tuple[Command, ...]] = (("TIME",),)


def _offset(reply: list[Any] | Exception, sent: float, round_trip: float) -> ClockOffset | None:
    """This host's clock against Redis's ``TIME`` reply (seconds, microseconds: bytes from the
    serial connection, integers from a Cluster client); None if it did not answer."""
    if isinstance(reply, Exception):
        return None
    try:
        store_time = int(reply[0]) + int(reply[1]) / 1_000_000
    except (IndexError, TypeError, ValueError):
        return None
    return ClockOffset.measured(sent, round_trip, store_time)


def _describe(exc: BaseException) -> str:
    """An error's type and first line, without credentials (redis-py's messages name hosts
    and commands, never passwords)."""
    text = str(exc).strip().splitlines()
    first = text[0][:160] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
