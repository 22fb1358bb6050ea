"""The seal's routes: ``GET /v1/sys/seal-status`` (unsigned, like /readyz: an operator or a
probe asks before any client can sign) and ``POST /v1/sys/unseal`` (an admin client submits one
Shamir share; on a server that holds its master key it only reports the status)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api.routes.crypto import json_response
from service.api.schemas import UnsealRequest, parse_model
from service.auth.policy import client_from_scope
from service.errors import Forbidden
from service.seal import Seal, SealStatus

log = logging.getLogger("cryptd.seal")

router = APIRouter(tags=["seal"])

SEAL_STATUS_PATH = "/v1/sys/seal-status"
UNSEAL_PATH = "/v1/sys/unseal"


def status_body(status: SealStatus) -> dict[str, object]:
    body: dict[str, object] = {
        "sealed": status.sealed,
        "threshold": status.threshold,
        "progress": status.progress,
        "type": status.kind,
        "available": status.available,
        "refused": status.refused,
    }
    if status.reason is not None:
        body["reason"] = status.reason
    return body


@router.get(SEAL_STATUS_PATH)
async def seal_status(request: Request) -> Response:
    seal: Seal = request.app.state.seal
    return json_response(status_body(await run_in_threadpool(seal.status)))


@router.post(UNSEAL_PATH)
async def unseal(request: Request) -> Response:
    client = client_from_scope(request.scope)
    if not client.admin:
        raise Forbidden("unsealing needs an admin client")
    body = parse_model(UnsealRequest, await request.body())
    seal: Seal = request.app.state.seal
    submit: Callable[[str], SealStatus] | None = getattr(seal, "submit", None)
    if submit is None:
        return json_response(status_body(await run_in_threadpool(seal.status)))
    try:
        status = await run_in_threadpool(submit, body.share)
    except Exception as exc:
        log.warning(
            "unseal share refused",
            extra={"client": client.client_id, "reason": str(exc), "request_id": _id(request)},
        )
        raise
    log.info(
        "unseal share accepted",
        extra={
            "client": client.client_id,
            "progress": status.progress,
            "threshold": status.threshold,
            "sealed": status.sealed,
            "request_id": _id(request),
        },
    )
    if not status.sealed:
        activate: Callable[[], Awaitable[None]] | None = getattr(
            request.app.state, "activate", None
        )
        if activate is not None:
            await activate()
    return json_response(status_body(status))


def _id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))
