"""One Redis connection pool for the replay store and the rate limiter, tuned to fail fast.

redis-py's defaults (5 s socket timeouts, 10 retries with back-off) would turn a Redis outage
into multi-second stalls on every request. Here a dead Redis costs one refused connect or
one 250 ms timeout, and the pool reconnects by itself when Redis is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

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


class PipelineBatcher:
    """Sends the Redis commands of concurrent requests together, in one pipeline
    (see :mod:`service.auth.coalesce` for why)."""

    def __init__(self, client: Redis, *, max_batch: int = 256) -> None:
        self.client = client
        self._coalescer: Coalescer[Command, Any] = Coalescer(self._pipeline, max_batch=max_batch)

    async def execute(self, *command: Any) -> Any:
        """The reply to ``command``; a command error comes back as a value (an exception
        instance), a connection failure or timeout is raised (RedisError, OSError)."""
        return await self._coalescer.submit(command)

    async def _pipeline(self, commands: Sequence[Command]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


async def execute(client: Redis, *command: Any) -> Any:
    """``client.execute_command(*command)`` (redis-py leaves that method untyped)."""
    return await client.execute_command(*command)  # type: ignore[no-untyped-call]
