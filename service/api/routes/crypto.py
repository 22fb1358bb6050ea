"""POST /v1/{encrypt,decrypt,sign,verify,rewrap,datakey,hmac}/{key}: single item or batch, one
path."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from service.api import deps
from service.api.schemas import PARSERS, parse_json_object
from service.engine import Item, OpName, Outcome, RewrapItem, error_entry, translate
from service.errors import CryptdError, InvalidRequest, PayloadTooLarge
from service.keys.keyring import check_key_name

router = APIRouter(prefix="/v1", tags=["crypto"])

OPERATIONS: tuple[OpName, ...] = (
    "encrypt",
    "decrypt",
    "sign",
    "verify",
    "rewrap",
    "datakey",
    "hmac",
)
BATCHABLE: tuple[OpName, ...] = OPERATIONS
# Operations that reveal plaintext or commit a key to a statement: one audit line per request.
AUDITED: frozenset[OpName] = frozenset({"decrypt", "sign", "rewrap", "datakey", "hmac"})


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def _check_to_key(request: Request, item: Item) -> None:
    if isinstance(item, RewrapItem) and item.to_key is not None:
        check_key_name(item.to_key)
        deps.note(request, to_key=item.to_key)
        deps.authorize(request, item.to_key, "encrypt")


async def handle(request: Request, op: OpName, key: str) -> bytes:
    """The whole operation (policy, body, runner, audit): the JSON body of the 200 answer.
    Raises CryptdError for the error model."""
    if op not in AUDITED:
        return orjson.dumps(await _execute(request, op, key))
    try:
        result = await _execute(request, op, key)
    except CryptdError as exc:
        _audit(request, op, key, exc.code, None, 1)
        raise
    entries = result.get("batch", [result])
    failures = sum("error" in entry for entry in entries)
    outcome = "ok" if failures == 0 else ("error" if failures == len(entries) else "partial")
    versions = [e["key_version"] for e in entries if "key_version" in e]
    _audit(request, op, key, outcome, versions, len(entries))
    return orjson.dumps(result)


def _audit(
    request: Request, op: OpName, key: str, outcome: str, versions: list[int] | None, items: int
) -> None:
    target = None
    if op == "rewrap":
        target = request.scope.get("state", {}).get("to_key")
    deps.services(request).audit.record(
        op,
        client=deps.client_id(request),
        key=key,
        outcome=outcome,
        key_version=versions[0] if versions and len(versions) == 1 else versions,
        request_id=request.scope.get("state", {}).get("request_id"),
        items=items,
        target_key=target,
    )


async def _execute(request: Request, op: OpName, key: str) -> dict[str, Any]:
    check_key_name(key)
    deps.note(request, key=key, operation=op)
    deps.authorize(request, key, op)
    services = deps.services(request)
    document = parse_json_object(await request.body())
    parse = PARSERS[op]

    if "batch" not in document or op not in BATCHABLE:
        item = parse(document)
        _check_to_key(request, item)
        (outcome,) = await services.runner.run(op, key, [item])
        if isinstance(outcome, CryptdError):
            raise outcome
        deps.note(request, key_version=outcome.get("key_version"))
        return outcome

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
            _check_to_key(request, item)
        except CryptdError as exc:
            outcomes[index] = exc
            continue
        good.append(item)
        positions.append(index)
    for index, outcome in zip(positions, await services.runner.run(op, key, good), strict=True):
        outcomes[index] = outcome
    return {
        "batch": [error_entry(translate(o)) if isinstance(o, Exception) else o for o in outcomes]
    }


def _register(op: OpName) -> None:
    async def endpoint(request: Request, key: str) -> Response:
        return Response(await handle(request, op, key), media_type="application/json")

    endpoint.__name__ = op
    router.add_api_route(
        f"/{op}/{{key}}",
        endpoint,
        methods=["POST"],
    )
    route = router.routes[-1]
    assert isinstance(route, APIRoute)
    ROUTES[op] = route


# The routes (metrics labels, 405 answers); requests reach `handle` via api.dispatch. Their
# bodies and answers are declared in service/api/spec.py (the OpenAPI document).
ROUTES: dict[OpName, APIRoute] = {}
for _op in OPERATIONS:
    _register(_op)
