"""create_app(settings): wiring and lifespan only.

Over 400 lines because it is the one place where every part meets (stores, seal, audit, pool,
auth, approvals, readiness checks, background tasks); each part's logic lives in its own
module and only its construction and start/stop order are here, so the order can be read in
one file."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from service import __version__
from service.api import docs, errors
from service.api.auditing import audit_readiness, open_audit_trail
from service.api.clock_readiness import ClockReadiness
from service.api.deps import ReadinessCheck, Services
from service.api.middleware import HeadAsGet
from service.api.pipeline import RequestPipeline
from service.api.replay_readiness import ReplayReadiness
from service.api.routes import approvals as approvals_route
from service.api.routes import crypto, health, keys, random, transfer
from service.api.routes import master_key as master_key_route
from service.api.routes import metrics as metrics_route
from service.api.routes import seal as seal_route
from service.api.spec import allowed_methods
from service.api.timing import RequestTimer
from service.asgi import ASGIApp, Receive, Scope, Send
from service.auth.authenticator import Authenticator
from service.auth.replay_host import sibling_directory
from service.auth.setup import build_auth
from service.batchcost import BatchLimits
from service.config import Settings
from service.crypto.registry import KEY_TYPES
from service.edge.protocol import REJECTION_HOOK
from service.keys.board import Board
from service.keys.manager import MIN_AUTO_ROTATE_PERIOD, KeyManager
from service.keys.masterkey import MasterKey
from service.keys.propagation import Propagation
from service.keys.watch import KeyringWatcher
from service.logs import configure_logging
from service.metrics import Metrics
from service.operations import Observer
from service.pool import InFlight, make_executor
from service.pool.base import Executor
from service.pool.lag import LoopLag
from service.pool_tasks import init_worker
from service.runner import CryptoRunner
from service.seal import Seal, open_seal
from service.seal.rotation import (
    KeyFiles,
    SealedKeyFiles,
    files_for,
    files_spec,
    settle_store,
)
from service.seal.static import WARNING as STATIC_SEAL_WARNING
from service.stores import open_store, open_usage_store
from service.usage.recorder import UsageRecorder

log = logging.getLogger("cryptd")


def _pkcs11_files(settings: Settings) -> KeyFiles | None:
    # Only the spec travels to the pool processes; no session is opened here.
    from service.seal.pkcs11 import Pkcs11Seal

    return SealedKeyFiles(Pkcs11Seal.from_settings(settings))


def _executors(
    settings: Settings, master_key: bytes, metrics: Metrics, cheap: InFlight
) -> dict[str, Executor]:
    """One executor per kind in use, shared by the key types configured for it; the sliced
    kind yields to the ``cheap`` requests in progress."""
    # Pool processes record their own crypto timings (multiprocess mode); without a shared
    # directory their figures would be lost, so they then go unrecorded rather than wrong.
    worker_observer: Observer | None = (
        metrics.observe_crypto if metrics.multiprocess_dir is not None else None
    )
    key_files = files_for(settings) if settings.seal != "pkcs11" else _pkcs11_files(settings)
    by_kind: dict[str, Executor] = {}
    for kind in sorted({settings.executor_kind(name) for name in KEY_TYPES}):
        process = kind == "process"
        by_kind[kind] = make_executor(
            kind,
            workers=settings.pool_workers,
            max_pending=settings.pool_max_pending,
            deadline=settings.pool_deadline,
            initializer=init_worker if process else None,
            initargs=(
                (
                    str(settings.keyring_file),
                    master_key,
                    settings.key_activation_delay,
                    worker_observer,
                    settings.keystore_url_value(),
                    files_spec(key_files),
                )
                if process
                else ()
            ),
            on_queue_wait=functools.partial(metrics.queue_wait, executor=kind),
            slice_budget=settings.slice_budget,
            slice_share=settings.slice_share,
            cheap=cheap,
        )
    return by_kind


STORE_CHECK_INTERVAL = 5.0  # seconds between looks at the stores' availability (metrics)


async def _every(
    interval: float, what: str, action: Callable[[], Awaitable[None]], *, first: bool = False
) -> None:
    """Run ``action`` every ``interval`` seconds until cancelled, whatever it raises (with
    ``first``, also once right away)."""
    delay = 0.0 if first else interval
    while True:
        await asyncio.sleep(delay)
        delay = interval
        try:
            await action()
        except Exception as exc:
            log.error(f"{what} failed", extra={"error_type": type(exc).__name__})


def create_app(
    settings: Settings | None = None,
    *,
    clock: Callable[[], float] = time.time,
    seal: Seal | None = None,
) -> FastAPI:
    """The application. ``clock`` is what request signatures' ``created`` is checked against
    (tests inject a fixed one to replay a known-answer vector; with Redis, readiness measures
    it against Redis's clock); ``seal``: one already unsealed
    (service/api/sealed.py), else the one the settings name, unsealed here."""
    settings = settings or Settings()
    # A file audit_log is the chained audit trail, built below once the keyring is open.
    to_file = settings.audit_log not in ("stderr", "off")
    logs = configure_logging(
        settings.log_level, settings.access_log, "off" if to_file else settings.audit_log
    )
    audit = logs.audit
    metrics = Metrics(enabled=settings.metrics, max_keys=settings.metrics_max_keys)
    seal = seal or open_seal(settings)
    master_key = seal.unseal()
    if seal.kind == "static" and settings.env == "production" and settings.worker_index == 0:
        log.warning(STATIC_SEAL_WARNING)
    store = open_store(settings.keystore_url_value(), settings.keyring_file)
    settle_store(settings, store, seal)  # a master-key rotation a SIGKILL interrupted
    manager = KeyManager(
        store,
        MasterKey(master_key),
        read_only=settings.keyring_read_only,
        activation_delay=settings.key_activation_delay,
        on_reload=metrics.keyring_reload,
        expected_deployment=settings.keystore_id,
        min_auto_rotate_period=1 if settings.env == "development" else MIN_AUTO_ROTATE_PERIOD,
        deletion_waiting_period=settings.deletion_waiting_period_value(),
        on_destroy=lambda name, date: audit.record(
            "key.destroy", client=None, key=name, outcome="ok", detail={"deletion_date": date}
        ),
        board=Board.in_directory(settings.runtime_dir),
        lookup=files_for(settings, seal),
    )
    manager.load()
    if to_file:
        audit = open_audit_trail(settings, manager, metrics.audit_write_failures)
    watcher = KeyringWatcher(manager, interval=settings.keyring_reload_interval)

    async def propagate(generation: int) -> Propagation:
        report = await watcher.replicas.confirm(generation, settings.propagation_timeout)
        metrics.key_change_propagated(report.waited, report.complete)
        if not report.complete:
            log.warning(
                "key change not confirmed by every replica in time",
                extra={
                    "generation": generation,
                    "replicas": report.replicas,
                    "confirmed": report.confirmed,
                    "missing": list(report.missing),
                },
            )
        return report

    usage = UsageRecorder(
        open_usage_store(settings.keystore_url_value(), settings.usage_file_path()),
        interval=settings.usage_flush_interval,
        on_counts=metrics.key_operations,
        on_flush=metrics.usage_flush,
    )

    cheap = InFlight()  # crypto requests in progress that sliced work yields to
    by_kind = _executors(settings, master_key, metrics, cheap)
    runner = CryptoRunner(
        manager,
        {name: by_kind[settings.executor_kind(name)] for name in KEY_TYPES},
        single_inline=settings.single_items_inline(),
        chunk_size=settings.pool_chunk_size,
        observer=metrics.observe_crypto,
        on_overload=functools.partial(metrics.rejected, "overload"),
        watcher=watcher,
        usage=usage,
        batch_limits=BatchLimits(
            settings.max_batch_items, settings.pool_deadline, settings.max_batch_items_by_type
        ),
    )
    auth = build_auth(settings, clock=clock)
    loop_lag = LoopLag(settings.max_loop_lag)

    async def pool_ready() -> tuple[bool, dict[str, Any]]:
        detail: dict[str, Any] = {}
        ok = True
        for kind, executor in by_kind.items():
            stats = executor.stats()
            detail[kind] = {"alive": stats.workers_alive, "workers": stats.workers}
            ok = ok and stats.workers_alive > 0
        return ok, detail

    # The replay store, and on Redis this host's clock against Redis's, in one probe.
    replay_readiness = ReplayReadiness(
        auth,
        max_skew=settings.signature_max_skew,
        max_age=settings.signature_max_age,
        on_offset=metrics.clock_offset,
    )
    # This host's clock, on Redis: against Redis's and, with PostgreSQL, its server's too.
    clock_readiness = ClockReadiness(
        replay_readiness,
        lambda: manager.store.server_clock(),
        clock=clock,
        max_skew=settings.signature_max_skew,
        max_age=settings.signature_max_age,
        on_offset=metrics.clock_offset,
    )

    # Which server worker answered (each has its own connections): lets a client or a test
    # reach every worker by opening connections until each index has been seen.
    server_detail = {"worker": settings.worker_index, "workers": settings.workers}

    async def server_ready() -> tuple[bool, dict[str, Any]]:
        return True, server_detail

    async def audit_ready() -> tuple[bool, dict[str, Any]]:
        return audit_readiness(audit)

    async def usage_ready() -> tuple[bool, dict[str, Any]]:
        # Usage is informational: a usage store that cannot be written leaves the pod ready.
        return True, usage.health()

    async def seal_ready() -> tuple[bool, dict[str, Any]]:
        # The master key is in memory: a seal whose token went away degrades, never unreadies.
        status = await run_in_threadpool(seal.status)
        detail: dict[str, Any] = {"kind": status.kind, "available": status.available}
        if not status.available:
            detail.update(degraded=f"seal: {status.reason}", reason=status.reason)
        return True, detail

    async def lease_ready() -> tuple[bool, dict[str, Any]]:
        # Keys are refused while the lease is out: the balancer should send requests elsewhere.
        why = await watcher.regain()
        if why is None:
            return True, {}
        return False, {"reason": f"keyring: {why}"}

    readiness: list[tuple[str, ReadinessCheck]] = [
        ("seal", seal_ready),
        ("keyring_lease", lease_ready),
        ("pool", pool_ready),
        *replay_readiness.checks(),  # replay_store,
        *clock_readiness.checks(),  # then clock, which judges its probe (Redis only)
        ("audit", audit_ready),
        ("server", server_ready),
        ("usage", usage_ready),
    ]

    async def publish_pool_gauges() -> None:
        for kind, executor in by_kind.items():
            stats = executor.stats()
            metrics.pool_gauges(
                stats.queued, stats.in_flight, executor=kind, max_pending=stats.max_pending
            )

    async def publish_store_gauges() -> None:
        # cryptd_store_up for the alert rules (k8s/monitoring): the key store as the watcher
        # last found it, the replay store by a ping.
        metrics.store_up("key", manager.store_unreachable is None)
        metrics.store_up("replay", (await replay_readiness.health()).ok)
        clock_readiness.keystore()  # cryptd_clock_offset_seconds{store="keystore"}

    async def run_due_work() -> None:
        # Cheap when nothing is due (a look at the snapshot); the work runs in a thread, in
        # one process of all replicas (the store's lock): automatic rotations, and the
        # destruction of keys whose deletion date has passed.
        if manager.has_due_work():
            await run_in_threadpool(manager.run_due)

    def on_hangup(loop: asyncio.AbstractEventLoop) -> None:
        # SIGHUP: reload the keyring, start a new audit file (the chain goes on in it).
        loop.create_task(run_in_threadpool(manager.reload))
        audit.rotate()

    authenticators: list[Authenticator] = []  # edge()'s, stopped at shutdown

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        for executor in by_kind.values():
            await executor.start()
        # The replay store's epoch starts now, not at the first request (readiness says
        # until when requests signed before it are refused).
        await auth.start()
        # What startup built (FastAPI, pydantic schemas, keys: ~77k objects) lives until exit.
        # Frozen, it is no longer walked by every full collection (17 ms each here), which
        # showed as the tail of batch latency: P99 33-41 ms -> 20-23 ms.
        gc.collect()
        gc.freeze()
        sys.setswitchinterval(settings.gil_switch_interval)
        loop_lag.start()
        # The store is checked once per interval (one stat, or one small query) and, for
        # PostgreSQL, on every notification; a Kubernetes Secret update arrives as a swapped
        # symlink with no signal to the process.
        watcher.start()
        tasks = [
            asyncio.create_task(_every(1.0, "pool gauges", publish_pool_gauges)),
            asyncio.create_task(
                _every(STORE_CHECK_INTERVAL, "store gauges", publish_store_gauges, first=True)
            ),
            asyncio.create_task(
                _every(settings.auto_rotate_check_interval, "scheduled key work", run_due_work)
            ),
            asyncio.create_task(usage.run()),
        ]
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, lambda: on_hangup(loop))
        try:
            # The lifespan state reaches the server's protocol: it counts the requests it
            # refuses itself (431, 408, malformed HTTP) with the other rejections.
            yield {REJECTION_HOOK: metrics.rejected}
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # After the server stopped taking requests: the last counts reach the store.
            await usage.close()
            await watcher.close()
            await loop_lag.close()
            for executor in by_kind.values():
                await executor.close()
            for authenticator in authenticators:
                await authenticator.aclose()
            await auth.aclose()
            await run_in_threadpool(manager.store.close)
            await run_in_threadpool(seal.close)
            manager.board.close()
            metrics.close()
            # Drain the writer threads; later lines (uvicorn's last ones) are written at once,
            # since a worker re-raising SIGTERM ends without running exit handlers.
            audit.close()  # its last records, and a checkpoint over them
            for writer in logs.writers:
                writer.close()

    def edge(fastapi_stack: ASGIApp) -> ASGIApp:
        # Every request passes the pipeline's checks once; the crypto operations are then
        # answered by their endpoint, everything else by FastAPI's stack.
        authenticator = Authenticator(
            registry_provider=auth.clients,
            replay=auth.replay,
            rate_limiter=auth.rate_limiter,
            max_age=settings.signature_max_age,
            max_skew=settings.signature_max_skew,
            fail_open=settings.replay_fail_open,
            on_failure=metrics.auth_failure,
            on_rejection=metrics.rejected,
            clock=clock,
        )
        authenticators.append(authenticator)
        return RequestPipeline(
            HeadAsGet(fastapi_stack, lambda path: "GET" in allowed_methods(path)),
            endpoint=functools.partial(crypto.handle, services),
            routes=crypto.ROUTES,
            authenticator=authenticator,
            max_body_bytes=settings.max_body_bytes,
            on_body_rejected=metrics.rejected,
            timer=RequestTimer.of(metrics, logs.access_log),
            overloaded=lambda: loop_lag.overloaded,
            on_overload=functools.partial(metrics.rejected, "overload"),
            cheap=cheap,
            costly=runner.sliced,
            audit=audit,
        )

    services = Services(
        keys=manager,
        runner=runner,
        usage=usage,
        max_batch_items=settings.max_batch_items,
        readiness=readiness,
        audit=audit,
        propagate=propagate,
    )
    app = Service(
        edge=edge,
        title="cryptd",
        version=__version__,
        description="Encryption as a service: keys stay inside, operations come in over REST.",
        lifespan=lifespan,
        # An API answers the path it was given: no 307 to the path with(out) a trailing slash
        # (a redirect of a signed request would need signing again; "%2F" names are 400).
        redirect_slashes=False,
        # The document is built from service/api/spec.py; docs.install serves it and the pages.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = services
    app.state.seal = seal
    app.state.seal_settings = settings  # what a master-key rotation writes to
    errors.install(app)
    app.include_router(health.router)
    app.include_router(seal_route.router)
    approvals_route.install(
        app, approvals_route.ApprovalPolicy(settings.approval_operations(), settings.approval_ttl)
    )
    app.include_router(approvals_route.router)
    app.include_router(master_key_route.router)
    app.include_router(transfer.router)  # before keys: GET /v1/keys/wrapping-key
    app.include_router(keys.router)
    app.include_router(crypto.router)
    app.include_router(random.router)
    docs.install(
        app,
        enabled=settings.docs_enabled(),
        required=settings.docs is True,
        # The page signs as the development client in development only (never in production).
        dev_client=docs.DevClient(
            docs.DEV_CLIENT_ID,
            lambda client_id: auth.clients().secret_for(client_id),
            settings.host,
        )
        if settings.env == "development"
        else None,
    )

    app.include_router(metrics_route.router(metrics))

    return app


class Service(FastAPI):
    """FastAPI with cryptd's edge outside FastAPI's own middleware stack.

    Every request passes the request pipeline once (:mod:`service.api.pipeline`: request id,
    body limit, signature check, timing); then the crypto operations go straight to their
    endpoint and everything else through FastAPI's exception handling and router."""

    def __init__(self, *, edge: Callable[[ASGIApp], ASGIApp], **options: Any) -> None:
        """``edge(fastapi_stack) -> app``: the layers every request passes first."""
        self._edge = edge
        super().__init__(**options)

    def build_middleware_stack(self) -> ASGIApp:
        return self._edge(super().build_middleware_stack())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette's entry, not FastAPI's: FastAPI's looks up OpenTelemetry providers (and
        # reads the environment) on every request, ~7 us, for an integration cryptd does not
        # use (it has its own metrics). No root_path is configured, the one other thing it does.
        # Starlette.__call__'s body, inlined: one coroutine fewer that every suspension of the
        # request (replay store, audit) passes through on its way out and back.
        scope["app"] = self
        stack = self.middleware_stack
        if stack is None:
            stack = self.middleware_stack = self.build_middleware_stack()
        await stack(scope, receive, send)


def app_factory() -> ASGIApp:
    """Entry point for ``uvicorn --factory`` (each server worker process builds its own app).
    Workers a process manager spawned with no shared store (``uvicorn --workers N``) get the
    host store and board of their siblings: each one's memory would accept a replay once per
    worker, and serve a key a sibling deleted."""
    settings = Settings()
    shared = sibling_directory()
    if shared is not None and settings.redis_url is None and settings.replay_dir is None:
        settings = settings.model_copy(update={"replay_dir": shared})
    if shared is not None and settings.runtime_dir is None:
        settings = settings.model_copy(update={"runtime_dir": shared})
    if settings.seal == "shamir":
        # Starts sealed: the full application is built once operators' shares unseal it.
        from service.api.sealed import SealedService
        from service.seal.shamir import ShamirSeal

        configure_logging(settings.log_level, settings.access_log, "off")
        final = settings
        return SealedService(
            settings,
            ShamirSeal(settings.sealed_master_key_path()),
            lambda seal: create_app(final, seal=seal),
        )
    return create_app(settings)
