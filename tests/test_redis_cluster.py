"""The replay store and the rate limiter on a real three-node Redis Cluster: nonces spread
over every node by their hash tags, a batch checked slot by slot, a restarted node's lost
nonces never replayed, and a cluster missing slots, or a Redis that is no cluster, named."""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import exceptions as redis_exceptions
from redis.crc import key_slot

from service.auth.ratelimit import RedisRateLimiter
from service.auth.redis_client import (
    RedisConfigError,
    check_target,
    close,
    open_client,
    parse_url,
    sender,
)
from service.auth.replay import (
    PARTITIONS,
    RedisReplayStore,
    StoreRecovering,
    StoreUnavailable,
    partition_tags,
)
from service.errors import RateLimited
from tests.test_auth_support import SHARED_REDIS_URL, require_redis
from tests.test_redis_support import ClusterSetup, client, cluster_setup, command, wait_until

pytestmark = pytest.mark.slow


async def test_cluster_spreads_nonces_refuses_replays_and_survives_a_node_restart(
    tmp_path: Path,
) -> None:
    with cluster_setup(tmp_path) as cluster:
        redis = open_client(cluster.url)
        await check_target(redis, parse_url(cluster.url))
        store = RedisReplayStore(redis, max_skew=1)
        limiter = RedisRateLimiter(redis, rate=0.5, burst=1)
        try:
            health = await store.establish()  # every partition's epoch, at start
            assert not health.ok
            await asyncio.sleep(health.retry_after or 1)
            health = await store.health()
            assert health.ok
            # TIME went with the partitions' scripts: this host's clock against a node's.
            assert health.clock is not None
            assert abs(health.clock.offset) < 1

            now = int(time.time())
            nonces = [uuid.uuid4().hex for _ in range(300)]
            results = await asyncio.gather(
                *(store.remember("app", n, now, 120) for n in nonces + nonces)
            )
            assert results == [True] * 300 + [False] * 300
            held = [int(client(node.port).dbsize()) for node in cluster.nodes]
            print(f"\nkeys per node (nonces, epoch and identity keys): {held}")
            assert all(count > 50 for count in held), held  # every node holds its share

            await limiter.acquire("app")
            with pytest.raises(RateLimited):
                await limiter.acquire("app")

            # A node restarts empty: what it held is gone, yet none of it is accepted again.
            victim = cluster.nodes[1]
            victim.kill()
            victim.start()
            wait_until(
                "the cluster to serve every slot again",
                lambda: "cluster_state:ok" in command(victim.port, "CLUSTER", "INFO").decode(),
                30,
            )
            verdicts = []
            for nonce in nonces:
                verdicts.append(await _verdict(store, nonce, now))
            assert True not in verdicts
            assert "recovering" in verdicts  # the restarted node's partitions
            assert False in verdicts  # the other nodes still remember theirs

            # Slots nobody serves: readiness says so, requests are refused, none accepted.
            deleted = set(_slots_of(victim.port))
            command(victim.port, "CLUSTER", "DELSLOTS", *map(str, sorted(deleted)))
            await asyncio.sleep(0.5)
            health = await store.health()
            if health.ok:  # the other nodes learn it over the cluster bus
                wait_until(
                    "the cluster to notice the missing slots",
                    lambda: (
                        "cluster_state:fail"
                        in command(cluster.nodes[0].port, "CLUSTER", "INFO").decode()
                    ),
                    15,
                )
                health = await store.health()
            assert not health.ok
            assert "unreachable" in str(health.reason) or "Cluster" in str(health.reason)
            orphan = next(n for n in _nonces() if _slot(store, n) in deleted)
            with pytest.raises(StoreUnavailable):
                await store.remember("app", orphan, int(time.time()), 120)
            # A server starting on that cluster: a reason, and refusals, never a crash.
            late = open_client(cluster.url)
            late_store = RedisReplayStore(late)
            try:
                await check_target(late, parse_url(cluster.url))
                health = await late_store.health()
                assert not health.ok
                assert health.reason is not None
                with pytest.raises(StoreUnavailable):
                    await late_store.remember("app", orphan, int(time.time()), 120)
            finally:
                await late_store.aclose()
                await close(late)
        finally:
            await limiter.aclose()
            await store.aclose()
            await close(redis)


async def _verdict(store: RedisReplayStore, nonce: str, created: int) -> bool | str:
    deadline = time.monotonic() + 20
    while True:
        try:
            return await store.remember("app", nonce, created, 120)
        except StoreRecovering:
            return "recovering"
        except StoreUnavailable:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)


def _nonces() -> Iterator[str]:
    while True:
        yield uuid.uuid4().hex


def _slot(store: RedisReplayStore, nonce: str) -> int:
    """The slot of the partition ``nonce`` falls in (the store's placement, recomputed)."""
    tags = partition_tags(PARTITIONS)
    return int(key_slot(tags[zlib.crc32(f"app:{nonce}".encode()) % len(tags)].encode()))


def _slots_of(port: int) -> list[int]:
    me = command(port, "CLUSTER", "MYID").decode()
    slots: list[int] = []
    for start, end, *nodes in command(port, "CLUSTER", "SLOTS"):
        if nodes[0][2].decode() == me:
            slots += range(int(start), int(end) + 1)
    return slots


async def test_a_redis_that_is_no_cluster_is_refused_at_start() -> None:
    require_redis()
    url = SHARED_REDIS_URL.removesuffix("/0") + "?cluster=true"
    redis = open_client(url)
    try:
        with pytest.raises(RedisConfigError, match="not a Redis Cluster"):
            await check_target(redis, parse_url(url))
    finally:
        await close(redis)


async def test_a_reply_received_while_the_event_loop_stalled_is_read_on_a_cluster(
    tmp_path: Path,
) -> None:
    """The hot path's per-slot commands (ClusterConnection, redis-py's cluster client) read a
    reply that came in while the event loop stalled past the 250 ms read timeout, as on one
    Redis (tests/test_replay.py); a node that does not answer still times out."""
    with cluster_setup(tmp_path) as cluster:
        redis = open_client(cluster.url)
        connection = sender(redis)
        loop = asyncio.get_running_loop()
        nothing = f"cryptd-test:stall:{uuid.uuid4().hex}"
        try:
            assert await connection.pipeline([("PING",)]) == [True]
            sent = _blpop_calls(cluster)
            # The node answers after 50 ms; the loop stalls from 20 ms to 420 ms.
            loop.call_later(0.02, time.sleep, 0.4)
            assert await connection.pipeline([("BLPOP", nothing, "0.05")]) == [None]
            # Read, not timed out and sent again (the client's one retry would hide the lost
            # reply, at the cost of running the command twice).
            assert _blpop_calls(cluster) == sent + 1
            # A node silent for 2 s: a timeout (a value in its place), after one period (or
            # two: a late timer, or the client's one retry), or the stall and one more.
            started = time.monotonic()
            [reply] = await connection.pipeline([("BLPOP", nothing, "2")])
            assert isinstance(reply, redis_exceptions.TimeoutError)
            assert 0.24 < time.monotonic() - started < 1.5
            started = time.monotonic()
            loop.call_later(0.02, time.sleep, 0.4)
            [reply] = await connection.pipeline([("BLPOP", nothing, "2")])
            assert isinstance(reply, redis_exceptions.TimeoutError)
            assert 0.6 < time.monotonic() - started < 2.0
            assert await connection.pipeline([("PING",)]) == [True]
        finally:
            await connection.aclose()
            await close(redis)


def _blpop_calls(cluster: ClusterSetup) -> int:
    """BLPOP commands the cluster's nodes have run."""
    stats = [client(node.port).info("commandstats") for node in cluster.nodes]
    return sum(int(s.get("cmdstat_blpop", {}).get("calls", 0)) for s in stats)
