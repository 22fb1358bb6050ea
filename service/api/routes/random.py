"""POST /v1/random: bytes from the operating system's CSPRNG (no key involved)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from starlette.responses import Response

from service import b64
from service.api import deps
from service.api.routes.crypto import json_response
from service.api.schemas import RandomRequest, parse_model, random_size

router = APIRouter(prefix="/v1", tags=["random"])


@router.post("/random")  # declared in service/api/spec.py
async def random_bytes(request: Request) -> Response:
    deps.note(request, operation="random")
    deps.authorize_keyless(request, "random")
    size = random_size(parse_model(RandomRequest, await request.body()))
    # os.urandom is getrandom(2): the kernel CSPRNG, never a user-space generator.
    return json_response({"random": b64.encode(os.urandom(size))})
