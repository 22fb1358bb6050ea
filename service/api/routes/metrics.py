"""GET /metrics: the Prometheus exposition of every process of this host (no authentication)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.metrics import Metrics


def router(metrics: Metrics) -> APIRouter:
    """The route that serves ``metrics``."""
    scrape_router = APIRouter()

    @scrape_router.get("/metrics")
    async def scrape() -> Response:
        # Reading every process's files takes milliseconds: off the event loop.
        body, content_type = await run_in_threadpool(metrics.render)
        return Response(body, media_type=content_type)

    return scrape_router
