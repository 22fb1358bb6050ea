"""create_app(settings): wiring and lifespan only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from service import __version__
from service.api import errors
from service.api.deps import ReadinessCheck, Services
from service.api.middleware import BodyLimitMiddleware, RequestIdMiddleware
from service.api.routes import crypto, health, keys
from service.auth.middleware import SignatureAuthMiddleware
from service.auth.setup import build_auth
from service.config import Settings
from service.crypto.registry import KEY_TYPES
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.pool import make_executor
from service.pool.base import Executor
from service.runner import CryptoRunner
from service.worker import init_worker

log = logging.getLogger("cryptd")


def _executors(
    settings: Settings, master_key: bytes, on_queue_wait: Callable[[float], None] | None
) -> dict[str, Executor]:
    """One executor per kind in use, shared by the key types configured for it."""
    by_kind: dict[str, Executor] = {}
    for kind in sorted(set(settings.executors.values())):
        by_kind[kind] = make_executor(
            kind,
            workers=settings.pool_workers,
            max_pending=settings.pool_max_pending,
            deadline=settings.pool_deadline,
            initializer=init_worker if kind == "process" else None,
            initargs=(
                (str(settings.keyring_file), master_key, settings.key_activation_delay)
                if kind == "process"
                else ()
            ),
            on_queue_wait=on_queue_wait,
        )
    return by_kind


async def _watch_keyring(manager: KeyManager, interval: float) -> None:
    """Poll the keyring file: a Kubernetes Secret update arrives as a swapped symlink, with no
    signal to the process. One stat per interval; the reload itself runs in a thread."""
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(manager.reload_if_changed)
        except Exception as exc:  # keep watching whatever happens
            log.error("keyring watch failed", extra={"error_type": type(exc).__name__})


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    master_key = settings.load_master_key()
    manager = KeyManager(
        settings.keyring_file,
        MasterKey(master_key),
        read_only=settings.keyring_read_only,
        activation_delay=settings.key_activation_delay,
    )
    manager.load()

    by_kind = _executors(settings, master_key, None)
    executors = {name: by_kind[settings.executors[name]] for name in KEY_TYPES}
    runner = CryptoRunner(manager, executors, chunk_size=settings.pool_chunk_size)

    async def pool_ready() -> tuple[bool, dict[str, Any]]:
        detail: dict[str, Any] = {}
        ok = True
        for kind, executor in by_kind.items():
            stats = executor.stats()
            detail[kind] = {"alive": stats.workers_alive, "workers": stats.workers}
            ok = ok and stats.workers_alive > 0
        return ok, detail

    auth = build_auth(settings)

    async def replay_ready() -> tuple[bool, dict[str, Any]]:
        ok = await auth.replay.ping()
        return ok, {"backend": "redis" if auth.redis is not None else "memory"}

    readiness: list[tuple[str, ReadinessCheck]] = [
        ("pool", pool_ready),
        ("replay_store", replay_ready),
    ]
    services = Services(
        keys=manager,
        runner=runner,
        max_batch_items=settings.max_batch_items,
        readiness=readiness,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for executor in by_kind.values():
            await executor.start()
        watcher = asyncio.create_task(
            _watch_keyring(manager, settings.keyring_reload_interval), name="keyring-watch"
        )
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(
                signal.SIGHUP, lambda: loop.create_task(run_in_threadpool(manager.reload))
            )
        try:
            yield
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            for executor in by_kind.values():
                await executor.close()
            await auth.aclose()

    app = FastAPI(
        title="cryptd",
        version=__version__,
        description="Encryption as a service: keys stay inside, operations come in over REST.",
        lifespan=lifespan,
    )
    app.state.services = services
    errors.install(app)
    app.include_router(health.router)
    app.include_router(keys.router)
    app.include_router(crypto.router)

    # Starlette wraps in reverse order: the last added runs first.
    app.add_middleware(
        SignatureAuthMiddleware,
        registry_provider=auth.clients,
        replay=auth.replay,
        rate_limiter=auth.rate_limiter,
        max_age=settings.signature_max_age,
        fail_open=settings.replay_fail_open,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    return app


def app_factory() -> FastAPI:
    """Entry point for ``uvicorn --factory`` (each server worker process builds its own app)."""
    return create_app(Settings())
