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
    keyring_check: dict[str, Any] = {
        "ok": True,
        "generation": keys.keyring.generation,
        "keys": len(keys.keyring),
    }
    if keys.last_reload_error is not None:
        # The previous keyring still serves; the failed reload is reported, not fatal.
        keyring_check["last_reload_error"] = keys.last_reload_error
    checks["keyring"] = keyring_check
    for name, check in services.readiness:
        ok, detail = await check()
        checks[name] = {"ok": ok, **detail}
        ready = ready and ok
    status = "ready" if ready else "not_ready"
    if ready and keys.last_reload_error is not None:
        status = "degraded"
    return json_response({"status": status, "checks": checks}, status=200 if ready else 503)
