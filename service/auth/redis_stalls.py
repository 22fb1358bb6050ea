"""redis-py's connections made tolerant of the event loop's own stalls.

redis-py times every read with the socket timeout and every connect with the connect timeout,
each an ``asyncio.timeout``: a reply received (a connection accepted) while the loop was held
up past it would end as a timeout (service/auth/read_deadline.py says how). Mixed into every
connection class service/auth/redis_client.py uses (plain, TLS, Unix socket, Sentinel-managed,
the Sentinels' own, a Cluster's nodes), :class:`_StallTolerant` times both with a
:class:`~service.auth.read_deadline.ReadDeadline` instead.
"""

from __future__ import annotations

import math
from typing import Any, Final, TypeVar, cast

import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from service.auth.read_deadline import ReadDeadline


class _StallTolerant(AbstractConnection):
    """Mixed into redis-py's connection classes: a read timed by the connection's socket
    timeout (any command's reply, the connection handshake's, a Sentinel's), and the connect
    itself, are timed by a :class:`~service.auth.read_deadline.ReadDeadline` instead of
    ``asyncio.timeout``, so a reply received (a connection accepted) while the event loop
    stalled is used, not turned into a timeout (and, with the client's one retry, the command
    sent again)."""

    __slots__ = ()

    async def _connect(self) -> None:
        limit = self.socket_connect_timeout
        if not limit:
            await self._open()
            return
        # redis-py's _connect times itself with socket_connect_timeout: off while it runs
        # (asyncio.timeout(None)), the deadline instead. disconnect() reads it too: restored
        # whatever happens.
        self.socket_connect_timeout = None
        try:
            async with ReadDeadline(limit):
                await self._open()
        finally:
            self.socket_connect_timeout = limit

    async def _open(self) -> None:
        # The class this is mixed into has the connect (TCP, TLS or Unix socket).
        await super()._connect()  # type: ignore[safe-super,no-untyped-call]

    async def read_response(
        self,
        disable_decoding: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 (redis-py's signature)
        *,
        disconnect_on_error: bool = True,
        push_request: bool | None = False,
    ) -> Any:
        limit = self.socket_timeout
        if timeout is not None or not limit:  # the caller times the read itself
            return await super().read_response(
                disable_decoding,
                timeout,
                disconnect_on_error=disconnect_on_error,
                push_request=push_request,
            )
        try:
            async with ReadDeadline(limit):
                return await super().read_response(
                    disable_decoding,
                    math.inf,  # no timeout of redis-py's own
                    disconnect_on_error=disconnect_on_error,
                    push_request=push_request,
                )
        except TimeoutError:  # the deadline's (redis-py's own error is a RedisError)
            raise redis.exceptions.TimeoutError(
                f"Timeout reading from {self._host_error()}"
            ) from None


_Conn = TypeVar("_Conn", bound=AbstractConnection)
_STALL_TOLERANT: Final[dict[type[AbstractConnection], type[AbstractConnection]]] = {}


def stall_tolerant(cls: type[_Conn]) -> type[_Conn]:
    """``cls`` (plain, TLS, Unix socket, Sentinel-managed) with :class:`_StallTolerant`."""
    if issubclass(cls, _StallTolerant):
        return cls
    if cls not in _STALL_TOLERANT:
        bases = (_StallTolerant, cls)
        _STALL_TOLERANT[cls] = type(f"StallTolerant{cls.__name__}", bases, {"__module__": __name__})
    return cast(type[_Conn], _STALL_TOLERANT[cls])


def tolerate_stalls(pool: ConnectionPool) -> None:
    """Make the pool's future connections :func:`stall_tolerant` (it connects lazily)."""
    pool.connection_class = stall_tolerant(pool.connection_class)
