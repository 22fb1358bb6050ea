"""``POST /v1/sys/rotate-master-key`` (admin): a new master key where the seal keeps it and
every key version rewrapped under it, while crypto keeps serving (service/seal/rotation.py).

The answer comes once this host's workers enforce the new keyring (the board) and waits, at
most CRYPTD_PROPAGATION_TIMEOUT, for the other replicas, as a key change does. The request's
audit record names both master key ids (public fingerprints, never a key).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api import deps
from service.api.routes import approvals
from service.api.routes.crypto import json_response
from service.config import SealSettings
from service.errors import Conflict, CryptdError, InvalidRequest
from service.keys.propagation import HEADER
from service.seal import SealError
from service.seal.rotation import refuse_unless_file, rotate

router = APIRouter(tags=["seal"])

ROTATE_PATH = "/v1/sys/rotate-master-key"
EVENT = "sys.rotate-master-key"


@router.post(ROTATE_PATH)
async def rotate_master_key(request: Request) -> Response:
    deps.note(request, operation="rotate-master-key", audit_event=EVENT)
    deps.require_admin(request)
    if (await request.body()).strip() not in (b"", b"{}"):
        raise InvalidRequest("rotate-master-key takes no parameters (send {} or nothing)")
    services = deps.services(request)
    settings: SealSettings = request.app.state.seal_settings
    if settings.seal == "shamir":
        # New shares are printed once by the command, never carried in a response.
        raise Conflict(
            "CRYPTD_SEAL=shamir: rotate with `cryptd operator rotate-master-key`, which takes "
            "the current shares and prints the new ones; the running service moves to the new "
            "key as it sees the store change"
        )
    try:
        refuse_unless_file(settings, request.app.state.seal)
    except SealError as exc:
        raise Conflict(exc.message) from None  # this deployment's seal cannot take a new key
    # Dual control (CRYPTD_APPROVALS=rotate-master-key): 202 until a second admin approves.
    spent = await approvals.gate(request, "rotate-master-key")
    try:
        report = await run_in_threadpool(
            rotate, settings, services.keys.snapshot, request.app.state.seal
        )
    except CryptdError:  # refused, nothing changed: the approval stays usable
        await approvals.release(request, spent)
        raise
    deps.note(
        request,
        audit_outcome="ok",
        audit_detail={
            "previous_master_key_id": report.previous_master_key_id,
            "master_key_id": report.master_key_id,
            "versions": report.versions,
        },
    )
    propagation = await services.propagate(report.generation)
    return json_response(report.body(), headers={HEADER: propagation.header()})
