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
    for name, check in services.readiness:
        ok, detail = await check()
        checks[name] = {"ok": ok, **detail}
        ready = ready and ok
        if not ok:  # a check says why it fails ("reason"): the body names them all
            reasons.append(str(detail.get("reason") or f"{name} not ready"))
    status = "ready" if ready else "not_ready"
    degraded = any(check.get("degraded") for check in checks.values())
    if ready and (keys.store_error is not None or degraded):
        status = "degraded"
    body = {"status": status, "reasons": reasons, "checks": checks}
    return json_response(body, status=200 if ready else 503)
