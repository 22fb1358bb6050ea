"""Redis for the replay store and the rate limiter, tuned to fail fast.

redis-py's defaults (5 s socket timeouts, 10 retries with back-off) would turn a Redis outage
into multi-second stalls on every request. Here a dead Redis costs one refused connect or
one 250 ms timeout, and connections are remade by themselves when Redis is back.

The hot path (one replay check per request, one rate-limit call) goes through a
:class:`SerialConnection` fed by a :class:`~service.auth.coalesce.Coalescer`; the pooled
client serves the rest (readiness pings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service.auth.coalesce import Coalescer

SOCKET_TIMEOUT: Final = 0.25
POOL_TIMEOUT: Final = 0.25  # wait for a free connection at most this long
MAX_CONNECTIONS: Final = 64


def connect(
    url: str,
    *,
    socket_timeout: float = SOCKET_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
) -> Redis:
    """A client for ``url`` (``redis://``, ``rediss://`` or ``unix://``). Connects lazily."""
    pool: BlockingConnectionPool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=POOL_TIMEOUT,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        # One immediate retry: the first command on a pooled connection that Redis closed
        # (restart, failover) fails; the retry reconnects.
        retry=Retry(NoBackoff(), 1),
        retry_on_timeout=False,
        health_check_interval=0,
    )
    return Redis(connection_pool=pool)


async def close(client: Redis) -> None:
    """Close the client and its pool."""
    await client.aclose(close_connection_pool=True)


Command = tuple[Any, ...]  # arguments of execute_command, e.g. ("EVALSHA", sha, 1, key)


class SerialConnection:
    """One dedicated connection, one pipelined round trip at a time, outside the pool.

    The client's per-command path (pool checkout, retry wrapper, response callbacks) costs
    ~145 us of CPU per round trip here, this one ~80 us (docs/PERFORMANCE.md); a coalescer
    sends one batch at a time anyway, so one connection is all it needs."""

    def __init__(self, client: Redis) -> None:
        # Same URL, credentials, TLS and timeouts as the pool's connections.
        self._connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        self._lock = asyncio.Lock()

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """The replies, in order. An error reply comes back as a value (its exception
        instance); a lost connection or a timeout is raised (RedisError, OSError), and the
        connection is remade on the next call."""
        async with self._lock:
            connection = self._connection
            packed = connection.pack_commands(commands)
            try:
                await connection.send_packed_command(packed, check_health=False)
            except (redis.exceptions.ConnectionError, OSError):
                # A connection Redis closed (restart, failover) fails on first use; nothing of
                # the batch ran, so reconnect and send it once more.
                await connection.disconnect()
                await connection.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    # Any other failure drops the connection (redis-py's default): a later
                    # batch can never read this one's replies.
                    replies.append(await connection.read_response())
                except redis.exceptions.ResponseError as exc:
                    replies.append(exc)
            return replies

    async def aclose(self) -> None:
        await self._connection.disconnect()


class PipelineBatcher:
    """Sends the Redis commands of concurrent requests together, in one pipeline
    (see :mod:`service.auth.coalesce` for why)."""

    def __init__(self, client: Redis, *, max_batch: int = 256) -> None:
        self._connection = SerialConnection(client)
        self._coalescer: Coalescer[Command, Any] = Coalescer(
            self._connection.pipeline, max_batch=max_batch
        )

    async def execute(self, *command: Any) -> Any:
        """The reply to ``command``; a command error comes back as a value (an exception
        instance), a connection failure or timeout is raised (RedisError, OSError)."""
        return await self._coalescer.submit(command)

    async def aclose(self) -> None:
        await self._connection.aclose()
