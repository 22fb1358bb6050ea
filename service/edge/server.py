"""uvicorn's server with cryptd's edge: the protocol's limits in the configuration, TLS
handshakes bounded in time, and the TLS files watched for rotation."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from typing import Any

import uvicorn

from service.edge.protocol import EdgeLimits, EdgeProtocol
from service.edge.tls import TLSFactory

log = logging.getLogger("cryptd.server")

TLS_CHECK_TICKS = 10  # uvicorn ticks every 0.1 s: the TLS files are stat-ed once a second
STARTUP_FAILURE = 3  # uvicorn's exit status for a server whose startup failed


class EdgeConfig(uvicorn.Config):
    """uvicorn's configuration with :class:`EdgeProtocol` and its limits. Picklable: the
    supervisor hands it to every worker process."""

    def __init__(self, app: Any, *, edge: EdgeLimits, **options: Any) -> None:
        options.setdefault("http", EdgeProtocol)
        options.setdefault("ws", "none")  # no WebSocket route: every upgrade offer is ignored
        super().__init__(app, **options)
        self.edge = edge


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on (host, port); ``reuse_port`` joins the address's
    ``SO_REUSEPORT`` group (one socket per server worker, see service/cli/supervisor.py)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    # proto is IPPROTO_TCP (not 0), so accepted sockets get TCP_NODELAY from the event loop.
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class EdgeServer(uvicorn.Server):
    """Serves on sockets it is given (:func:`bind`), with the TLS handshake bounded by the
    header timeout, and the TLS files reloaded when they change."""

    config: EdgeConfig

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if not sockets:
            raise ValueError("EdgeServer serves on sockets made by service.edge.server.bind")
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=_loop,
            )

        loop = asyncio.get_running_loop()
        # asyncio's default handshake timeout is 60 s: a client that opens connections and
        # never finishes the handshake would hold each that long.
        handshake = config.edge.header_timeout if config.ssl is not None else None
        self.servers = [
            await loop.create_server(
                create_protocol,
                sock=sock,
                ssl=config.ssl,
                backlog=config.backlog,
                ssl_handshake_timeout=handshake,
            )
            for sock in sockets
        ]
        host, port = sockets[0].getsockname()[:2]
        scheme = "https" if config.ssl is not None else "http"
        log.info(f"cryptd listening on {scheme}://{host}:{port}")
        self.started = True

    async def on_tick(self, counter: int) -> bool:
        if counter % TLS_CHECK_TICKS == 0:
            factory = self.config.ssl_context_factory
            if isinstance(factory, TLSFactory) and factory.server_tls is not None:
                factory.server_tls.reload_if_changed()
        return await super().on_tick(counter)
