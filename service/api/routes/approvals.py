"""Dual control over HTTP (service/keys/approvals.py holds the records and their rules).

    GET  /v1/approvals/{id}          -> the approval and its state
    POST /v1/approvals/{id}/approve  -> 200, the approval (any admin but the requester)
    POST /v1/approvals/{id}/reject   -> 200, the approval (any admin; the requester withdraws)

A route whose operation may need approval calls :func:`gate` once the caller is known to be an
admin, before it changes anything: one line, ``await approvals.gate(request, "<operation>",
key)``. Without ``X-Approval-ID`` and with the operation named in ``CRYPTD_APPROVALS``, the
request is recorded and answered 202 (nothing runs); with the header the approval is spent
for this exact request, or the request is refused and nothing runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api import deps
from service.api.routes.crypto import json_response
from service.errors import CryptdError, Forbidden, KeyNotFound
from service.keys import approvals
from service.keys.approvals import Approval
from service.keys.document import KeyringDocument

router = APIRouter(prefix="/v1/approvals", tags=["approvals"])

R = TypeVar("R")


@dataclass(frozen=True)
class ApprovalPolicy:
    """``CRYPTD_APPROVALS`` and ``CRYPTD_APPROVAL_TTL``, on ``app.state.approvals``."""

    operations: frozenset[str] = frozenset()
    ttl: int = approvals.DEFAULT_TTL


class ApprovalPending(Exception):
    """Raised by :func:`gate` to answer 202 from wherever a route is (see :func:`install`)."""

    def __init__(self, response: Response) -> None:
        super().__init__("approval pending")
        self.response = response


def install(app: FastAPI, policy: ApprovalPolicy) -> None:
    app.state.approvals = policy

    async def pending(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApprovalPending)
        return exc.response

    app.add_exception_handler(ApprovalPending, pending)


def _policy(request: Request) -> ApprovalPolicy:
    found = getattr(request.app.state, "approvals", None)
    return found if isinstance(found, ApprovalPolicy) else ApprovalPolicy()


def _client(request: Request) -> str:
    client = deps.client_id(request)
    if client is None:  # dual control needs to tell clients apart
        raise Forbidden("dual control needs an authenticated client")
    return client


def _target(request: Request) -> str:
    query = request.scope.get("query_string", b"").decode("latin-1")
    return request.url.path + (f"?{query}" if query else "")


async def _in_store(request: Request, change: Callable[[KeyringDocument], R]) -> R:
    """``change`` over the stored approvals, in one key-store transaction shared by every
    worker and replica (nothing is written when it changes nothing)."""
    snapshot = deps.services(request).keys.snapshot
    return (await run_in_threadpool(snapshot.apply, change))[1]


async def gate(
    request: Request,
    operation: str | None,
    key: str | None = None,
    details: dict[str, str] | None = None,
    *,
    key_exists: bool = False,
) -> str | None:
    """Let the request run (return), or answer 202 with a new approval (raise
    :class:`ApprovalPending`). ``operation``: the :data:`~service.keys.approvals.OPERATIONS`
    name this request is, None when it is none of them (then ``X-Approval-ID`` is refused).
    ``key_exists``: a request for a key the store does not hold is 404 rather than an
    approval for nothing. Call it after the admin check and before any change."""
    header = request.headers.get(approvals.HEADER)
    policy = _policy(request)
    if header is None and operation not in policy.operations:
        return None
    client = _client(request)
    method, path, body, now = request.method, _target(request), await request.body(), time.time()
    if header is not None:
        approvals.check_id(header)
        deps.note(request, approval_id=header)
        await _in_store(
            request,
            lambda document: approvals.claim(
                document.approvals,
                header,
                client=client,
                operation=operation or "",
                method=method,
                path=path,
                body=body,
                now=now,
            ),
        )
        return header
    assert operation is not None

    def record(document: KeyringDocument) -> tuple[str, Approval]:
        if key_exists and (key is None or key not in document.keys):
            raise KeyNotFound()
        return approvals.request(
            document.approvals,
            operation=operation,
            key=key,
            method=method,
            path=path,
            body=body,
            client=client,
            ttl=policy.ttl,
            now=now,
            extra=details,
        )

    approval_id, approval = await _in_store(request, record)
    deps.note(request, approval_id=approval_id, audit_outcome="approval_requested")
    raise ApprovalPending(json_response(approval.view(approval_id, now), status=202))


def _noted(request: Request, event: str, approval_id: str) -> None:
    deps.note(request, operation=f"approval.{event}", audit_event=f"approval.{event}")
    approvals.check_id(approval_id)
    deps.note(request, approval_id=approval_id)


def held(request: Request, operation: str) -> bool:
    """Whether ``operation`` may be held for approval on this request (named in
    CRYPTD_APPROVALS, or an approval presented): worth reading what decides it."""
    return operation in _policy(request).operations or approvals.HEADER in request.headers


async def release(request: Request, approval_id: str | None) -> None:
    if approval_id is None:
        return
    client = _client(request)
    # Best effort: the operation's own error is the answer; if the store cannot take this
    # either, the approval stays spent (a new request is needed), never usable twice.
    with contextlib.suppress(CryptdError):
        await _in_store(
            request, lambda document: approvals.release(document.approvals, approval_id, client)
        )


async def stored_state(request: Request, key: str) -> str | None:
    """The key's state as the store holds it now (None: no such key), for a route whose
    operation depends on it (``enable``: ``disabled`` to ``enabled``)."""

    def read(document: KeyringDocument) -> str | None:
        found = document.keys.get(key)
        return None if found is None else found.state

    return await _in_store(request, read)


async def _decide(request: Request, approval_id: str, *, approve: bool) -> Response:
    _noted(request, "approve" if approve else "reject", approval_id)
    deps.require_admin(request)
    client = _client(request)
    now = time.time()
    decided: Approval = await _in_store(
        request,
        lambda document: approvals.decide(
            document.approvals, approval_id, client, approve=approve, now=now
        ),
    )
    deps.note(request, key=decided.key, audit_detail={"operation": decided.operation})
    return json_response(decided.view(approval_id, now))


@router.get("/{approval_id}", summary="an approval: what it is for, who asked, its state")
async def show_approval(request: Request, approval_id: str) -> Response:
    _noted(request, "read", approval_id)
    deps.require_admin(request)
    now = time.time()

    def read(document: KeyringDocument) -> Approval:
        found = document.approvals.get(approval_id)
        if found is None:
            raise approvals.ApprovalNotFound()
        return found

    found = await _in_store(request, read)
    deps.note(request, key=found.key)
    return json_response(found.view(approval_id, now))


@router.post("/{approval_id}/approve", summary="approve another admin's pending request")
async def approve(request: Request, approval_id: str) -> Response:
    return await _decide(request, approval_id, approve=True)


@router.post("/{approval_id}/reject", summary="reject (or, as its requester, withdraw) a request")
async def reject(request: Request, approval_id: str) -> Response:
    return await _decide(request, approval_id, approve=False)
