"""``GET /v1/sys/seal-status``: whether this server holds its master key (unsigned, like
/readyz: an operator or a probe asks before any client can be authenticated)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api.routes.crypto import json_response
from service.seal import Seal

router = APIRouter(tags=["seal"])

SEAL_STATUS_PATH = "/v1/sys/seal-status"


@router.get(SEAL_STATUS_PATH)
async def seal_status(request: Request) -> Response:
    seal: Seal = request.app.state.seal
    status = await run_in_threadpool(seal.status)
    body: dict[str, object] = {
        "sealed": status.sealed,
        "threshold": status.threshold,
        "progress": status.progress,
        "type": status.kind,
        "available": status.available,
    }
    if status.reason is not None:
        body["reason"] = status.reason
    return json_response(body)
