"""Key routes: list and describe (public data only), and admin key management."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api import deps
from service.api.routes.crypto import json_response
from service.api.schemas import CreateKeyRequest, UpdateKeyRequest, parse_model
from service.keys.keyring import check_key_name

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.get("")
async def list_keys(request: Request) -> Response:
    keyring = deps.services(request).keys.keyring
    keys = [
        {
            "name": key.name,
            "type": key.type.name,
            "latest_version": key.latest_version,
            "min_decryption_version": key.min_decryption_version,
        }
        for name, key in sorted(keyring.items())
        if deps.may_read(request, name)
    ]
    return json_response({"keys": keys})


@router.get("/{key}")
async def describe_key(request: Request, key: str) -> Response:
    check_key_name(key)
    deps.note(request, key=key, operation="read")
    deps.authorize(request, key, "read")
    return json_response(deps.services(request).keys.keyring.key(key).describe())


@router.post(
    "/{key}",
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": CreateKeyRequest.model_json_schema()}},
        }
    },
)
async def create_key(request: Request, key: str) -> Response:
    check_key_name(key)
    deps.note(request, key=key, operation="create")
    deps.require_admin(request)
    body = parse_model(CreateKeyRequest, await request.body())
    manager = deps.services(request).keys
    # Key generation (RSA-4096 takes seconds) and the file write stay off the event loop.
    created = await run_in_threadpool(
        manager.create, key, body.type, deletion_allowed=body.deletion_allowed
    )
    return json_response(created.metadata(), status=201)


@router.post("/{key}/rotate")
async def rotate_key(request: Request, key: str) -> Response:
    check_key_name(key)
    deps.note(request, key=key, operation="rotate")
    deps.require_admin(request)
    rotated = await run_in_threadpool(deps.services(request).keys.rotate, key)
    return json_response(rotated.metadata())


@router.patch(
    "/{key}",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": UpdateKeyRequest.model_json_schema()}},
        }
    },
)
async def update_key(request: Request, key: str) -> Response:
    check_key_name(key)
    deps.note(request, key=key, operation="update")
    deps.require_admin(request)
    body = parse_model(UpdateKeyRequest, await request.body())
    updated = await run_in_threadpool(
        deps.services(request).keys.update,
        key,
        min_decryption_version=body.min_decryption_version,
        deletion_allowed=body.deletion_allowed,
    )
    return json_response(updated.metadata())


@router.delete("/{key}", status_code=204)
async def delete_key(request: Request, key: str) -> Response:
    check_key_name(key)
    deps.note(request, key=key, operation="delete")
    deps.require_admin(request)
    await run_in_threadpool(deps.services(request).keys.delete, key)
    return Response(status_code=204)
