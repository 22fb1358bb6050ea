"""Key routes: list and describe (public data only), and admin key management."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.api import deps
from service.api.routes import approvals
from service.api.routes.crypto import json_response
from service.api.schemas import CreateKeyRequest, ImportKeyRequest, parse_model, parse_update
from service.errors import CryptdError
from service.keys.keyring import (
    DISABLED,
    ENABLED,
    RESERVED_NAMES,
    Key,
    check_key_name,
    check_new_key_name,
)
from service.keys.manager import KeyManager
from service.keys.propagation import HEADER
from service.usage.recorder import as_json as usage_json

router = APIRouter(prefix="/v1/keys", tags=["keys"])

Body = TypeVar("Body", bound=BaseModel)


def _not_reserved(key: str) -> None:
    """/v1/keys/wrapping-key is the import wrapping key (GET only): other methods there are 405
    (the Allow header says GET), not a user key's creation, update or deletion."""
    if key in RESERVED_NAMES:
        raise StarletteHTTPException(405)


def _audit(
    request: Request,
    event: str,
    outcome: str | None = None,
    version: int | None = None,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """What this request's audit record says (the pipeline writes it, one per request,
    before the answer leaves): ``key.<event>``, and on success its outcome and version."""
    fields: dict[str, Any] = {"audit_event": f"key.{event}"}
    if outcome is not None:
        fields["audit_outcome"] = outcome
    if version is not None:
        fields["key_version"] = version
    if detail:
        fields["audit_detail"] = detail
    deps.note(request, **fields)


# Dual-control operations on a key that must exist (import and restore make one).
_EXISTING = frozenset({"delete", "backup", "enable"})


class Managed(NamedTuple):
    """A key-management action's result, and the headers its answer carries."""

    key: Key | None
    headers: dict[str, str]

    @property
    def found(self) -> Key:
        assert self.key is not None
        return self.key


async def manage(
    request: Request,
    event: str,
    key: str,
    change: Callable[[], Key | None],
    outcome: Callable[[Key | None], tuple[str, Mapping[str, Any] | None]] | None = None,
    *,
    changes: bool = True,
    approval: str | None = None,
) -> Managed:
    """Run a key-management change off the event loop (RSA-4096 generation takes seconds;
    the file write fsyncs), naming it in the request's audit record (written whatever the
    outcome, by the pipeline). ``outcome(result)`` gives the record's outcome and detail
    (default: ok, none). ``approval``: the dual-control operation this request is (None:
    none), so CRYPTD_APPROVALS can hold it for a second admin (service/api/routes/approvals.py).

    A change (``changes``) is in force on every worker of this host once it returns (the
    board); the answer then waits, at most CRYPTD_PROPAGATION_TIMEOUT, for the other
    replicas to enforce it too, and says how far it got (``X-Cryptd-Propagation``)."""
    check_key_name(key)
    deps.note(request, key=key, operation=event)
    _audit(request, event)
    services = deps.services(request)
    deps.require_admin(request)
    spent = await approvals.gate(request, approval, key, key_exists=approval in _EXISTING)
    try:
        result = await run_in_threadpool(change)
    except CryptdError:  # refused, nothing changed: the approval may be carried out again
        await approvals.release(request, spent)
        raise
    status, detail = ("ok", None) if outcome is None else outcome(result)
    _audit(request, event, status, None if result is None else result.latest_version, detail)
    if not changes:
        return Managed(result, {})
    report = await services.propagate(services.keys.keyring.generation)
    return Managed(result, {HEADER: report.header()})


@router.get("")
async def list_keys(request: Request) -> Response:
    keyring = await deps.services(request).runner.current()
    keys = [
        {
            "name": key.name,
            "type": key.type.name,
            "latest_version": key.latest_version,
            "min_decryption_version": key.min_decryption_version,
            "min_encryption_version": key.min_encryption_version,
            "state": key.state,
        }
        for key in keyring.live()
        if deps.may_read(request, key.name)
    ]
    return json_response({"keys": keys})


@router.get("/{key}")
async def describe_key(request: Request, key: str) -> Response:
    check_key_name(key)
    deps.note(request, key=key, operation="read", audit_event="key.read")
    deps.authorize(request, key, "read")
    services = deps.services(request)
    _, found = await services.runner.key(key)
    described = found.describe()
    # Stored totals plus this worker's counts not flushed yet; null while unreadable.
    usage = await services.usage.usage(found)
    versions = cast(list[dict[str, object]], described["versions"])
    for entry in versions:
        entry["usage"] = None if usage is None else usage_json(usage[cast(int, entry["version"])])
    return json_response(described)


@router.post("/{key}", status_code=201)
async def create_key(request: Request, key: str) -> Response:
    _not_reserved(key)
    return await new_key(
        request, "create", key, CreateKeyRequest, lambda manager, body: create(manager, key, body)
    )


async def new_key(
    request: Request,
    event: str,
    key: str,
    model: type[Body],
    make: Callable[[KeyManager, Body], Key],
    approval: str | None = None,
) -> Response:
    """A key-management route that adds a key named ``key``: 201 and its metadata.
    ``make(manager, body)`` adds it, off the event loop, once the name is known to be free."""
    check_key_name(key)  # before the body: a bad name is 400 on every route
    body = parse_model(model, await request.body())
    manager = deps.services(request).keys

    def change() -> Key:
        check_new_key_name(key)
        return make(manager, body)

    created = await manage(request, event, key, change, approval=approval)
    return json_response(created.found.metadata(), status=201, headers=created.headers)


def create(
    manager: KeyManager,
    key: str,
    body: CreateKeyRequest | ImportKeyRequest,
    material: bytes | None = None,
) -> Key:
    """Create ``key`` with the settings of a create (or import) request's ``body``."""
    return manager.create(
        key,
        body.type,
        deletion_allowed=body.deletion_allowed,
        derived=body.derived,
        convergent=body.convergent,
        auto_rotate_period=body.auto_rotate_period,
        material=material,
    )


@router.post("/{key}/rotate")
async def rotate_key(request: Request, key: str) -> Response:
    manager = deps.services(request).keys
    rotated = await manage(request, "rotate", key, lambda: manager.rotate(key))
    return json_response(rotated.found.metadata(), headers=rotated.headers)


@router.patch("/{key}")
async def update_key(request: Request, key: str) -> Response:
    _not_reserved(key)
    check_key_name(key)
    body = parse_update(await request.body())
    manager = deps.services(request).keys
    previous: list[str] = []
    enabling = None
    if body.state == ENABLED and approvals.held(request, "enable"):  # disabled -> enabled
        deps.note(request, key=key, operation="update")
        _audit(request, "update")
        deps.require_admin(request)
        if await approvals.stored_state(request, key) == DISABLED:
            enabling = "enable"

    def change() -> Key:
        updated, before = manager.update_with_previous(
            key,
            min_decryption_version=body.min_decryption_version,
            deletion_allowed=body.deletion_allowed,
            auto_rotate_period=body.auto_rotate_period,
            state=body.state,
            min_encryption_version=body.min_encryption_version,
        )
        previous.append(before)
        return updated

    managed = await manage(request, "update", key, change, approval=enabling)
    updated = managed.found
    if previous and previous[0] != updated.state:
        _audit(  # the request's one record names the state change
            request,
            "state",
            "ok",
            updated.latest_version,
            {"state": updated.state, "previous_state": previous[0]},
        )
    return json_response(updated.metadata(), headers=managed.headers)


def _scheduled(result: Key | None) -> tuple[str, Mapping[str, Any] | None]:
    if result is None:
        return "ok", None
    return "scheduled", {"deletion_date": result.deletion_date}


@router.delete("/{key}", status_code=204)
async def delete_key(request: Request, key: str) -> Response:
    """204 when deleted at once; 202 with the metadata (``pending_deletion``, its
    ``deletion_date``) when CRYPTD_DELETION_WAITING_PERIOD schedules it."""
    _not_reserved(key)
    manager = deps.services(request).keys
    deleted = await manage(
        request, "delete", key, lambda: manager.delete(key), _scheduled, approval="delete"
    )
    if deleted.key is None:
        return Response(status_code=204, headers=deleted.headers)
    return json_response(deleted.key.metadata(), status=202, headers=deleted.headers)


def _restored(result: Key | None) -> tuple[str, Mapping[str, Any] | None]:
    return "ok", None if result is None else {"state": result.state}


@router.post("/{key}/cancel-deletion")
async def cancel_deletion(request: Request, key: str) -> Response:
    manager = deps.services(request).keys
    restored = await manage(
        request, "cancel_deletion", key, lambda: manager.cancel_deletion(key), _restored
    )
    return json_response(restored.found.metadata(), headers=restored.headers)
