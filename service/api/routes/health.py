"""Liveness and readiness (no authentication)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api import deps
from service.api.routes.crypto import json_response

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    services = deps.services(request)
    checks: dict[str, Any] = {}
    ready = True
    keys = services.keys
    keyring = keys.keyring
    keyring_check: dict[str, Any] = {
        "ok": True,
        "store": keys.store.backend,
        "generation": keyring.generation,
        "deployment_id": keyring.deployment_id,
        "keys": len(keyring),
    }
    # The keyring in memory still serves; a refused or unreachable store is reported as
    # degraded (key management answers 503 meanwhile), not as unready.
    if keys.last_reload_error is not None:
        keyring_check["last_reload_error"] = keys.last_reload_error
    if keys.store_unreachable is not None:
        keyring_check["store_unreachable"] = keys.store_unreachable
    checks["keyring"] = keyring_check
    reasons: list[str] = []
    degraded: list[str] = []
    retry_after = 1
    for name, check in services.readiness:
        ok, detail = await check()
        checks[name] = {"ok": ok, **detail}
        ready = ready and ok
        # A check says why it fails ("reason"), why it serves without a margin ("degraded"),
        # and how long its window lasts ("retry_after"): the body's reasons name them all.
        if not ok:
            reasons.append(str(detail.get("reason") or f"{name} not ready"))
            retry_after = max(retry_after, int(detail.get("retry_after") or 1))
        if detail.get("degraded"):
            degraded.append(str(detail["degraded"]))
    if keys.store_error is not None:
        degraded.append(f"key store: {keys.store_error}")
    status = "ready" if ready else "not_ready"
    if ready and degraded:
        status = "degraded"
    body = {"status": status, "reasons": reasons + degraded, "checks": checks}
    if ready:
        return json_response(body)
    return json_response(body, status=503, headers={"Retry-After": str(retry_after)})
