"""Redis for the replay store and the rate limiter, tuned to fail fast.

One job (over 400 lines): reaching Redis in its three shapes (one server, Sentinel, Cluster)
from one URL, with the fail-fast connection the hot path uses; splitting it would spread the
URL's meaning over several modules.

redis-py's defaults (5 s socket timeouts, 10 retries with back-off) would turn a Redis outage
into multi-second stalls on every request. Here a dead Redis costs one refused connect or
one 250 ms timeout, and connections are remade by themselves when Redis is back.

The hot path (one replay check per request, one rate-limit call) and the readiness probe's
replay-store check go through a :class:`SerialConnection` fed by a
:class:`~service.auth.coalesce.Coalescer` (a :class:`ClusterConnection` on a Cluster); the
pooled client serves the start-up checks, and its pool makes the serial connection.

Every connection made here (the pool's, the Sentinels', a Cluster's nodes') times its reads
and its connect with a :class:`~service.auth.read_deadline.ReadDeadline`, not redis-py's
``asyncio.timeout``: a reply received (a connection accepted) while the event loop stalled is
used, not turned into a timeout (the connection classes: service/auth/redis_stalls.py).
"""

from __future__ import annotations

import asyncio
import math
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException

from service.auth.coalesce import Coalescer
from service.auth.read_deadline import ReadDeadline
from service.auth.redis_stalls import stall_tolerant, tolerate_stalls

SOCKET_TIMEOUT: Final = 0.25
POOL_TIMEOUT: Final = 0.25  # wait for a free connection at most this long
MAX_CONNECTIONS: Final = 64

RedisClient = Redis | RedisCluster
# What a Redis call can raise when Redis cannot answer: redis-py's errors (a Cluster's
# RedisClusterException, e.g. slots nobody serves, is not a RedisError), sockets, timeouts.
REDIS_ERRORS: Final = (redis.exceptions.RedisError, RedisClusterException, OSError, TimeoutError)
Mode = Literal["standalone", "sentinel", "cluster"]

_TLS_PARAMETERS: Final = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SENTINEL_PARAMETERS: Final = ("sentinel_username", "sentinel_password")


class RedisConfigError(ValueError):
    """``CRYPTD_REDIS_URL`` cannot work as written (the message says why; no password)."""


@dataclass(frozen=True)
class RedisTarget:
    """What ``CRYPTD_REDIS_URL`` names: one Redis, a master behind Sentinels, or a Cluster."""

    mode: Mode
    url: str  # the URL itself (standalone: handed to redis-py as is)
    nodes: tuple[tuple[str, int], ...] = ()  # Sentinels, or the Cluster's seed nodes
    service: str = ""  # the Sentinel master name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: tuple[tuple[str, str], ...] = ()  # TLS files, the Sentinels' own credentials

    def describe(self) -> str:
        """For logs and /readyz: hosts and the master name, never a credential."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.nodes)
        if self.mode == "sentinel":
            return f"Sentinel {hosts} master {self.service!r}"
        if self.mode == "cluster":
            return f"Redis Cluster {hosts}"
        return "Redis"


def parse_url(url: str) -> RedisTarget:
    """``redis[s]://host:port[/db]`` (or ``unix://``), ``redis[s]+sentinel://h:p[,h:p...]/
    master[/db]``, ``redis[s]://h:p[,h:p...]?cluster=true``; refused with a clear reason
    otherwise (several hosts without ``cluster=true``, a Sentinel URL without a master...)."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel"):
        raise RedisConfigError(
            "CRYPTD_REDIS_URL must start with redis://, rediss://, unix://, redis+sentinel:// "
            "or rediss+sentinel://"
        )
    if scheme == "unix":
        return RedisTarget("standalone", url)
    rest, _, query = rest.partition("?")
    options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    cluster = options.pop("cluster", "false").lower()
    if cluster not in ("true", "false", "yes", "no", "1", "0"):
        raise RedisConfigError("CRYPTD_REDIS_URL: cluster= must be true or false")
    is_cluster = cluster in ("true", "yes", "1")
    netloc, _, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    nodes = tuple(_node(part) for part in hosts.split(",")) if hosts else ()
    tls = scheme.startswith("rediss")
    if scheme.endswith("+sentinel"):
        if is_cluster:
            raise RedisConfigError("CRYPTD_REDIS_URL: a Sentinel URL cannot be a Cluster")
        service, _, db = path.partition("/")
        if not nodes or not service:
            raise RedisConfigError(
                "CRYPTD_REDIS_URL: a Sentinel URL is redis+sentinel://host:port[,host:port...]"
                "/master-name[/db]"
            )
        return RedisTarget(
            "sentinel",
            url,
            nodes,
            urllib.parse.unquote(service),
            _db(db),
            username,
            password,
            tls,
            _options(options, _TLS_PARAMETERS + _SENTINEL_PARAMETERS),
        )
    if is_cluster:
        if not nodes:
            raise RedisConfigError("CRYPTD_REDIS_URL: a Cluster URL names at least one node")
        if _db(path) != 0:
            raise RedisConfigError("CRYPTD_REDIS_URL: Redis Cluster has database 0 only")
        return RedisTarget(
            "cluster",
            url,
            nodes,
            username=username,
            password=password,
            tls=tls,
            options=_options(options, _TLS_PARAMETERS),
        )
    if len(nodes) > 1:
        raise RedisConfigError(
            "CRYPTD_REDIS_URL names several hosts: add ?cluster=true for a Redis Cluster, or "
            "use redis+sentinel://sentinel:port[,...]/master-name for Sentinel"
        )
    # redis-py reads the other parameters itself; cluster=false is ours alone.
    kept = [(k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)]
    kept = [(k, v) for k, v in kept if k != "cluster"]
    plain = f"{scheme}://{rest}" + (f"?{urllib.parse.urlencode(kept)}" if kept else "")
    return RedisTarget("standalone", plain)


def _node(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = text, "6379"
    host = host.strip("[]")  # an IPv6 literal
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisConfigError(f"CRYPTD_REDIS_URL: {text!r} is not host:port")
    return host, int(port)


def _db(text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise RedisConfigError(f"CRYPTD_REDIS_URL: database {text!r} is not a number")
    return int(text)


def _options(given: dict[str, str], allowed: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise RedisConfigError(
            f"CRYPTD_REDIS_URL: unknown parameter(s) {', '.join(unknown)} "
            f"(known here: cluster, {', '.join(allowed)})"
        )
    return tuple(sorted(given.items()))


def open_client(url: str, *, socket_timeout: float = SOCKET_TIMEOUT) -> RedisClient:
    """A client for any ``url`` :func:`parse_url` takes, a Redis Cluster's included."""
    target = parse_url(url)
    if target.mode == "cluster":
        return _cluster(target, socket_timeout)
    return connect(target.url, socket_timeout=socket_timeout)


def connect(
    url: str,
    *,
    socket_timeout: float = SOCKET_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
) -> Redis:
    """A client for one Redis, or the primary Sentinels name (see :func:`parse_url`; a
    Cluster needs :func:`open_client`). Connects lazily."""
    target = parse_url(url)
    if target.mode == "cluster":
        raise RedisConfigError("a Redis Cluster URL needs open_client()")
    if target.mode == "sentinel":
        return _sentinel_master(target, socket_timeout, max_connections)
    pool: BlockingConnectionPool = BlockingConnectionPool.from_url(
        target.url,
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
    tolerate_stalls(pool)
    return Redis(connection_pool=pool)


def _tls(target: RedisTarget) -> dict[str, Any]:
    if not target.tls:
        return {}
    options = {k: v for k, v in target.options if k in _TLS_PARAMETERS}
    return {"ssl": True, **options}


def _sentinel_master(target: RedisTarget, timeout: float, max_connections: int) -> Redis:
    """A client of the master the Sentinels name: every new connection asks them where it is
    (redis-py's SentinelConnectionPool), so a failover is followed without a restart."""
    options = dict(target.options)
    sentinels = Sentinel(
        list(target.nodes),
        min_other_sentinels=0,
        sentinel_kwargs={
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "username": options.get("sentinel_username"),
            "password": options.get("sentinel_password"),
            **_tls(target),
        },
    )
    client: Redis = sentinels.master_for(
        target.service,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        db=target.db,
        username=target.username,
        password=target.password,
        retry=Retry(NoBackoff(), 1),
        retry_on_timeout=False,
        health_check_interval=0,
        max_connections=max_connections,
        **_tls(target),
    )
    tolerate_stalls(client.connection_pool)
    for sentinel in sentinels.sentinels:  # asked at every new connection: where is the master?
        tolerate_stalls(sentinel.connection_pool)
    return client


def _cluster(target: RedisTarget, timeout: float) -> RedisCluster:
    client = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        # Fail fast like the other modes; a moved slot or a failover still re-reads the
        # cluster's layout (redis-py does that on MOVED and on a lost connection).
        retry=Retry(NoBackoff(), 1),
        require_full_coverage=True,
        **_tls(target),
    )
    # redis-py takes no connection class for a Cluster: the seed nodes have theirs, and the
    # nodes it finds later get theirs from the layout's connection arguments.
    nodes = client.nodes_manager
    nodes.connection_kwargs["connection_class"] = stall_tolerant(
        nodes.connection_kwargs["connection_class"]
    )
    for node in nodes.startup_nodes.values():
        node.connection_class = stall_tolerant(node.connection_class)
    return client


async def check_target(client: RedisClient, target: RedisTarget) -> None:
    """Refuse, at start, a URL that can never work: a master no reachable Sentinel knows, a
    node that is not part of a Redis Cluster. Unreachable servers are not refused (they may
    come up later; readiness and every request say so meanwhile)."""
    if target.mode == "sentinel":
        assert isinstance(client, Redis)
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        answered = 0
        for sentinel in pool.sentinel_manager.sentinels:
            try:
                reply = await sentinel.execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.service
                )
            except REDIS_ERRORS:
                continue
            if reply:
                return
            answered += 1
        if answered:
            raise RedisConfigError(
                f"CRYPTD_REDIS_URL: no Sentinel of {target.describe()} knows a master named "
                f"{target.service!r}"
            )
    elif target.mode == "cluster":
        assert isinstance(client, RedisCluster)
        try:
            await client.initialize()
        except RedisClusterException as exc:
            if "cluster mode is not enabled" in str(exc).lower():
                raise RedisConfigError(
                    f"CRYPTD_REDIS_URL: {target.describe()} is not a Redis Cluster (drop "
                    "?cluster=true for a single Redis)"
                ) from None
        except REDIS_ERRORS:
            return


async def close(client: RedisClient) -> None:
    """Close the client and its pool."""
    if isinstance(client, RedisCluster):
        await client.aclose()
        return
    pool = client.connection_pool
    await client.aclose(close_connection_pool=True)
    if isinstance(pool, SentinelConnectionPool):  # the Sentinels' own clients too
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()


Command = tuple[Any, ...]  # arguments of execute_command, e.g. ("EVALSHA", sha, 1, key)


class SerialConnection:
    """One dedicated connection, one pipelined round trip at a time, outside the pool.

    The client's per-command path (pool checkout, retry wrapper, response callbacks) costs
    ~145 us of CPU per round trip here, this one ~80 us (docs/PERFORMANCE.md); a coalescer
    sends one batch at a time anyway, so one connection is all it needs."""

    def __init__(self, client: Redis) -> None:
        # Same URL, credentials, TLS and timeouts as the pool's connections.
        self._connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        self._timeout = self._connection.socket_timeout or SOCKET_TIMEOUT
        self._lock = asyncio.Lock()

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """The replies, in order. An error reply comes back as a value (its exception
        instance); a lost connection or a timeout is raised (RedisError, OSError), and the
        connection is remade on the next call."""
        async with self._lock:
            connection = self._connection
            packed = connection.pack_commands(commands)
            try:
                await self._connected()
                await connection.send_packed_command(packed, check_health=False)
            except (redis.exceptions.ConnectionError, OSError):
                # A connection Redis closed (restart, failover) fails on first use; nothing of
                # the batch ran, so reconnect and send it once more.
                await connection.disconnect()
                await self._connected()
                await connection.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            # The batch's replies are timed here, not per reply by redis-py: a loop that
            # stalled past the timeout must not turn a reply already received into a
            # timeout (service/auth/read_deadline.py).
            try:
                async with ReadDeadline(self._timeout):
                    for _ in commands:
                        try:
                            # Any other failure drops the connection (redis-py's default): a
                            # later batch can never read this one's replies.
                            replies.append(await connection.read_response(timeout=math.inf))
                        except redis.exceptions.ResponseError as exc:
                            replies.append(exc)
            except TimeoutError:
                raise redis.exceptions.TimeoutError(
                    f"Timeout reading from Redis: no reply within {self._timeout} s"
                ) from None
            return replies

    async def _connected(self) -> None:
        """Connect through ``connect()``: a Sentinel-managed connection asks the Sentinels
        for the primary there (send_packed_command alone would connect to its default host,
        localhost:6379, whatever Redis that is)."""
        if not self._connection.is_connected:
            await self._connection.connect()

    async def aclose(self) -> None:
        await self._connection.disconnect()


class ClusterConnection:
    """:class:`SerialConnection`'s interface on a Redis Cluster: each command goes to the node
    serving its keys' slot (redis-py follows MOVED and re-reads the layout after a lost node),
    the commands of one call concurrently, each reply or error in its place."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        return list(await asyncio.gather(*(self._one(command) for command in commands)))

    async def _one(self, command: Command) -> Any:
        # Every failure comes back as a value: a node that is down or moving refuses its own
        # commands, and the other nodes' replies still count.
        try:
            return await self._client.execute_command(*command)
        except REDIS_ERRORS as exc:
            return exc

    async def aclose(self) -> None:
        return None  # the client's connections are closed with it


Sender = SerialConnection | ClusterConnection


def sender(client: RedisClient) -> Sender:
    """The hot path's way to ``client``: one dedicated connection, or per-slot routing."""
    if isinstance(client, RedisCluster):
        return ClusterConnection(client)
    return SerialConnection(client)


class PipelineBatcher:
    """Sends the Redis commands of concurrent requests together, in one pipeline
    (see :mod:`service.auth.coalesce` for why)."""

    def __init__(self, client: RedisClient, *, max_batch: int = 256) -> None:
        self._connection = sender(client)
        self._coalescer: Coalescer[Command, Any] = Coalescer(
            self._connection.pipeline, max_batch=max_batch
        )

    async def execute(self, *command: Any) -> Any:
        """The reply to ``command``; a command error comes back as a value (an exception
        instance), a connection failure or timeout is raised (RedisError, OSError)."""
        return await self._coalescer.submit(command)

    async def aclose(self) -> None:
        await self._connection.aclose()
