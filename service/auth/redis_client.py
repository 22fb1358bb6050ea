"""One Redis connection pool for the replay store and the rate limiter, tuned to fail fast.

redis-py's defaults (5 s socket timeouts, 10 retries with back-off) would turn a Redis outage
into multi-second stalls on every request. Here a dead Redis costs one refused connect or
one 250 ms timeout, and the pool reconnects by itself when Redis is back.
"""

from __future__ import annotations

from typing import Final

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

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
    pool = BlockingConnectionPool.from_url(
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
