"""A server started sealed (``CRYPTD_SEAL=shamir``): what it answers until it holds its master
key, and the hand-over to the full application once it does.

While sealed, each server worker answers ``/healthz`` (alive), ``/readyz`` (503, not ready),
``GET /v1/sys/seal-status`` (unsigned) and ``POST /v1/sys/unseal`` (signed, an admin client);
every other ``/v1/`` route gets 503 ``sealed`` from the request pipeline. Shares are kept per
worker, in memory only: ``cryptd operator unseal`` submits each share to every worker of the
server. The worker that reaches the threshold builds the full application
(``create_app(settings, seal=...)``), runs its lifespan start-up here and from then on hands it
every request; its lifespan shut-down runs when the server stops. A restart seals again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from service.api import errors
from service.api.errors import send_cryptd_error
from service.api.pipeline import RequestPipeline
from service.api.routes import crypto
from service.api.routes import seal as seal_route
from service.asgi import ASGIApp, Receive, Scope, Send
from service.auth.authenticator import Authenticator
from service.auth.setup import build_auth
from service.config import Settings
from service.errors import CryptdError, Sealed
from service.keys.store import KeystoreError
from service.seal.base import SealError
from service.seal.shamir import ShamirSeal

log = logging.getLogger("cryptd.seal")


class SealedService:
    """The ASGI application of a sealed server worker; ``build(seal)`` makes the full one."""

    def __init__(
        self, settings: Settings, seal: ShamirSeal, build: Callable[[ShamirSeal], ASGIApp]
    ):
        self.settings = settings
        self.seal = seal
        self._build = build
        self._inner: ASGIApp | None = None
        self._inner_lifespan: _Lifespan | None = None
        self._activating = asyncio.Lock()
        self._switching = False
        self._state: dict[str, Any] | None = None  # the server's lifespan state (per request)
        self._auth = build_auth(settings)
        self._sealed_stack = self._make_stack()

    def _make_stack(self) -> ASGIApp:
        app = FastAPI(
            lifespan=self._lifespan,
            openapi_url=None,
            docs_url=None,
            redoc_url=None,
            redirect_slashes=False,
        )
        app.state.seal = self.seal
        app.state.activate = self.activate
        errors.install(app)
        app.include_router(seal_route.router)

        worker = {"worker": self.settings.worker_index, "workers": self.settings.workers}

        @app.get("/healthz")
        async def healthz() -> Response:
            return crypto.json_response({"status": "ok"})

        @app.get("/readyz")
        async def readyz(request: Request) -> Response:
            status = self.seal.status()
            seal = {"ok": False, **seal_route.status_body(status)}
            return crypto.json_response(
                {"status": "not_ready", "checks": {"seal": seal, "server": {"ok": True, **worker}}},
                status=503,
            )

        authenticator = Authenticator(
            registry_provider=self._auth.clients,
            replay=self._auth.replay,
            rate_limiter=self._auth.rate_limiter,
            max_age=self.settings.signature_max_age,
            max_skew=self.settings.signature_max_skew,
            fail_open=self.settings.replay_fail_open,
        )

        async def refuse(scope: Scope, body: bytes, operation: Any, key: str) -> bytes:
            raise Sealed()

        return RequestPipeline(
            app,
            endpoint=refuse,
            routes=crypto.ROUTES,
            authenticator=authenticator,
            max_body_bytes=self.settings.max_body_bytes,
            sealed=True,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        yield

    async def activate(self) -> None:
        """Build the full application with the unsealed seal and start it (once)."""
        async with self._activating:
            if self._inner is not None:
                return
            # The full application opens its own replay store, which this process may hold
            # open once (LMDB): the sealed stack's closes first, and requests arriving during
            # the hand-over are answered 503 sealed.
            self._switching = True
            try:
                await self._auth.aclose()
                try:
                    inner = self._build(self.seal)
                    lifespan = _Lifespan(inner)
                    state = await lifespan.start()
                except Exception as exc:
                    self._auth = build_auth(self.settings)
                    self._sealed_stack = self._make_stack()
                    log.error(
                        "unsealed, but the service did not start",
                        extra={"error_type": type(exc).__name__},
                    )
                    reason = str(exc) if isinstance(exc, CryptdError | KeystoreError) else ""
                    raise SealError(
                        "the shares opened the master key, but the service did not start"
                        + (f": {reason}" if reason else "")
                        + "; fix the cause and submit any share again"
                    ) from None
            finally:
                self._switching = False
            if self._state is not None:
                self._state.update(state)
            self._inner, self._inner_lifespan = inner, lifespan
            log.info(
                "unsealed: serving",
                extra={
                    "worker": self.settings.worker_index,
                    "threshold": self.seal.split.threshold,
                },
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._serve_lifespan(scope, receive, send)
            return
        inner = self._inner
        if inner is not None:
            await inner(scope, receive, send)
        elif self._switching and scope["type"] == "http":
            await send_cryptd_error(send, Sealed("the service is unsealing: try again"))
        else:
            await self._sealed_stack(scope, receive, send)

    async def _serve_lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._state = scope.get("state")
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                log.warning(
                    "sealed: waiting for unseal shares",
                    extra={
                        "threshold": self.seal.split.threshold,
                        "worker": self.settings.worker_index,
                    },
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._inner_lifespan is not None:
                    await self._inner_lifespan.stop()
                await self._auth.aclose()
                self.seal.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Lifespan:
    """Drives an ASGI application's lifespan from here (the server already ran its own)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._state: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> dict[str, Any]:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        scope["state"] = self._state
        self._task = asyncio.create_task(
            self._app(scope, self._incoming.get, self._outgoing.put)  # type: ignore[arg-type]
        )
        await self._incoming.put({"type": "lifespan.startup"})
        answer = await self._outgoing.get()
        if answer["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the application did not start: {answer.get('message', '')}")
        return self._state

    async def stop(self) -> None:
        await self._incoming.put({"type": "lifespan.shutdown"})
        await self._outgoing.get()
        if self._task is not None:
            await self._task
