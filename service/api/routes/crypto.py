"""POST /v1/{encrypt,decrypt,sign,verify,rewrap,datakey,hmac,encapsulate,decapsulate}/{key}:
single item or batch, one path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

import orjson
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from service.api import deps
from service.api.deps import Services
from service.api.items import PARSERS
from service.api.schemas import parse_json_object
from service.asgi import Scope
from service.auth.clients import Client
from service.auth.policy import authorize, client_from_scope
from service.errors import CryptdError, InvalidRequest, PayloadTooLarge
from service.keys.keyring import check_key_name
from service.operations import Item, OpName, Outcome, RewrapItem, error_entry, translate

router = APIRouter(prefix="/v1", tags=["crypto"])

OPERATIONS: tuple[OpName, ...] = get_args(OpName)  # every crypto operation, in its order
BATCHABLE: tuple[OpName, ...] = OPERATIONS


def json_response(
    content: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(content), status_code=status, media_type="application/json", headers=headers
    )


def _check_to_key(scope: Scope, client: Client, item: Item) -> None:
    if isinstance(item, RewrapItem) and item.to_key is not None:
        check_key_name(item.to_key)
        scope["state"]["to_key"] = item.to_key
        authorize(client, item.to_key, "encrypt")


async def handle(services: Services, scope: Scope, body: bytes, op: OpName, key: str) -> bytes:
    """The whole operation on an authenticated request whose body is ``body`` (policy,
    body, runner): the JSON body of the 200 answer. Raises CryptdError for the error model.
    Request-scoped fields for the logs and the request's audit record (written by the
    pipeline, service/api/auditing.py) go to ``scope["state"]``. (One coroutine for the
    whole operation: each one between the pipeline and the runner costs every request.)"""
    check_key_name(key)
    state = scope.setdefault("state", {})
    state["key"] = key
    state["operation"] = op
    client = client_from_scope(scope)
    authorize(client, key, op)
    document = parse_json_object(body)
    parse = PARSERS[op]

    if "batch" not in document or op not in BATCHABLE:
        item = parse(document)
        state["audit_values"] = (item,)  # its AAD, context, signer id: HMAC'd in the record
        _check_to_key(scope, client, item)
        (outcome,) = await services.runner.run(op, key, [item])
        if isinstance(outcome, CryptdError):
            raise outcome
        state["key_version"] = outcome.get("key_version")
        return orjson.dumps(outcome)

    raw_items = document["batch"]
    if len(document) != 1 or not isinstance(raw_items, list):
        raise InvalidRequest('a batch request is {"batch": [item, ...]} and nothing else')
    if not raw_items:
        raise InvalidRequest("batch is empty")
    if len(raw_items) > services.max_batch_items:
        raise PayloadTooLarge(f"batch holds more than {services.max_batch_items} items")

    outcomes: list[Outcome | None] = [None] * len(raw_items)
    good: list[Item] = []
    positions: list[int] = []
    for index, raw in enumerate(raw_items):
        try:
            if not isinstance(raw, dict):
                raise InvalidRequest("batch item must be a JSON object")
            item = parse(raw)
            _check_to_key(scope, client, item)
        except CryptdError as exc:
            outcomes[index] = exc
            continue
        good.append(item)
        positions.append(index)
    state["audit_values"] = tuple(good)
    for index, outcome in zip(positions, await services.runner.run(op, key, good), strict=True):
        outcomes[index] = outcome
    entries: list[Any] = [
        error_entry(translate(o)) if isinstance(o, Exception) else o for o in outcomes
    ]
    failures = sum("error" in entry for entry in entries)
    if failures:
        state["audit_outcome"] = "error" if failures == len(entries) else "partial"
    state["key_version"] = tuple(sorted({e["key_version"] for e in entries if "key_version" in e}))
    state["audit_items"] = len(entries)
    return orjson.dumps({"batch": entries})


def _register(op: OpName) -> None:
    async def endpoint(request: Request, key: str) -> Response:
        # Declared for the OpenAPI document and the metrics' route labels; requests reach
        # `handle` through service.api.pipeline (this runs only if something routes here).
        content = await handle(deps.services(request), request.scope, await request.body(), op, key)
        return Response(content, media_type="application/json")

    endpoint.__name__ = op
    router.add_api_route(
        f"/{op}/{{key}}",
        endpoint,
        methods=["POST"],
    )
    route = router.routes[-1]
    assert isinstance(route, APIRoute)
    ROUTES[op] = route


# The routes (metrics labels, 405 answers); requests reach `handle` via api.pipeline. Their
# bodies and answers are declared in service/api/spec.py (the OpenAPI document).
ROUTES: dict[OpName, APIRoute] = {}
for _op in OPERATIONS:
    _register(_op)
