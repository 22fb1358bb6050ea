"""The audit hook of the request pipeline: one record per API request, durable before the
answer's first byte leaves.

Every ``/v1/`` answer passes :class:`AuditedSend`: a 2xx when its status is known, a refusal
once its (small) error body is complete, so the record names the error code. The record comes
from what the request noted in ``scope["state"]`` (the client, the key, the operation, the
versions, the routes' ``audit_*`` fields). When the record could not be written and the audit
fails closed, the answer is replaced by 503 ``audit_unavailable``: never a 2xx without its
record. A request that never got an answer (the client left before its body arrived) was
neither authenticated nor refused and has no record.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from service.asgi import Scope, Send, route_path, send_error
from service.audit.checkpoint import SIGNING_KEY
from service.audit.redact import HMAC_KEY
from service.audit.syslog import SyslogSink
from service.auth.policy import STATE_KEY
from service.config import Settings
from service.keys.manager import KeyManager
from service.logs.audit import Audit, RequestRecord

RETRY_AFTER = b"5"
_new_record = tuple.__new__


class AuditedSend:
    def __init__(self, audit: Audit, scope: Scope, send: Send, request_id: bytes) -> None:
        self.audit = audit
        self.request_id = request_id
        self.scope = scope
        self.send = send
        self.committed = False
        self._held: dict[str, Any] | None = None
        self._body: list[bytes] = []
        self.replaced = False
        """True when the answer became 503 audit_unavailable."""
        trail = audit.trail
        if trail is not None:  # Audit.begin(), one call fewer per request
            trail.begin()

    async def __call__(self, message: Any) -> None:
        if self.replaced:
            return
        kind = message["type"]
        if kind == "http.response.start" and not self.committed:
            status = message["status"]
            if status >= 400:  # wait for the body: the record names the error code
                self._held = message
                return
            if await self.commit(status):
                await self.send(message)
            return
        held = self._held
        if kind == "http.response.body" and held is not None:
            self._body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            self._held = None
            body = b"".join(self._body)
            if await self.commit(held["status"], _code(body)):
                await self.send(held)
                await self.send({"type": "http.response.body", "body": body})
            return
        await self.send(message)

    async def abandon(self) -> None:
        """The app failed after starting an error answer it never finished: that request
        still gets its record (``internal``)."""
        if self._held is not None and not self.committed:
            self._held = None
            self.committed = True
            await self.audit.commit(record_of(self.scope, 500, "internal"), begun=True)

    def close(self) -> None:
        """The request is over: one that never committed a record (its client went away
        before answering was possible) is no longer waited for by the others' group."""
        if not self.committed:
            self.committed = True
            self.audit.end()

    async def commit(self, status: int, code: str | None = None) -> bool:
        """Write the record; False when the answer was replaced by 503 audit_unavailable.
        The caller of a successful answer not yet started then sends it itself."""
        return await self.written(status, code) or not await self.refuse()

    def written(self, status: int, code: str | None = None) -> Awaitable[bool]:
        """:meth:`commit` for the crypto 200, which the pipeline awaits itself: True once the
        record is durable; on False the caller awaits :meth:`refuse`. (The trail's future, not
        a coroutine: the request waits here for the sync, and every coroutine between costs
        one more object and one more step on the way out and back.)"""
        self.committed = True
        audit = self.audit
        trail = audit.trail
        if trail is not None:  # Audit.commit(), one call fewer per request
            return trail.commit(line_of(audit, self.scope, status, code), begun=True)
        return audit.commit(record_of(self.scope, status, code), begun=True)

    async def refuse(self) -> bool:
        """The record was not written: True when the answer became 503 audit_unavailable
        (the audit fails closed), False when the request is answered all the same."""
        if not self.audit.fail_closed:
            return False
        self.replaced = True
        await send_error(
            self.send,
            503,
            "audit_unavailable",
            "the audit record of this request could not be written; nothing is answered"
            " without one (see /readyz)",
            [(b"retry-after", RETRY_AFTER), (b"x-request-id", self.request_id)],
        )
        return True


def _code(body: bytes) -> str | None:
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def line_of(audit: Audit, scope: Scope, status: int, code: str | None) -> bytes | RequestRecord:
    """The trail's record of a usual request, serialized at once, as :func:`record_of` and
    ``audit.body`` would make it: no record object built and read again. Else (a request
    refused before its endpoint, a rewrap, a detail, a sensitive value, a first record of its
    kind) the :func:`record_of`, serialized with its group."""
    state = scope.get("state") or {}
    event = state.get("audit_event") or state.get("operation")
    if (
        event is None
        or state.get("audit_detail")
        or state.get("approval_id")
        or (event == "rewrap" and state.get("to_key") is not None)
    ):
        return record_of(scope, status, code)
    outcome = state.get("audit_outcome", "ok") if status < 400 else code or f"http_{status}"
    versions = state.get("key_version")
    if isinstance(versions, tuple) and len(versions) == 1:
        versions = versions[0]
    when = time.time()
    repeated = (
        event,
        outcome,
        status,
        getattr(state.get(STATE_KEY), "client_id", None),
        state.get("key"),
        versions,
        state.get("audit_items", 1),
    )
    try:
        line = audit.plain_body(
            when, repeated, state.get("request_id"), state.get("audit_values", ())
        )
    except Exception:  # a field it cannot serialize: the group write refuses that record alone
        line = None
    return line if line is not None else record_of(scope, status, code)


def record_of(scope: Scope, status: int, code: str | None) -> RequestRecord:
    state = scope.get("state") or {}
    client = state.get(STATE_KEY)
    event = state.get("audit_event") or state.get("operation")
    method = path = None
    key = state.get("key")
    if event is None and state.get("crypto_operation"):  # refused before its endpoint ran
        event = state["crypto_operation"]
        key = scope.get("path_params", {}).get("key")
    if event is None:
        method = scope.get("method")
        route = scope.get("route")
        if route is not None and hasattr(route, "path"):
            event = f"{method} {route.path}"
        else:  # refused before routing (401, 413, ...): which path it asked for
            event = "request"
            path = route_path(scope)
    outcome = state.get("audit_outcome", "ok") if status < 400 else code or f"http_{status}"
    versions = state.get("key_version")
    detail = state.get("audit_detail")
    if state.get("approval_id"):  # dual control: which approval this request made or spent
        detail = {**(detail or {}), "approval_id": state["approval_id"]}
    if isinstance(versions, tuple) and len(versions) == 1:
        versions = versions[0]
    # tuple.__new__: the named tuple's own __new__ is a Python function, one call more.
    return _new_record(
        RequestRecord,
        (
            time.time(),
            event,
            outcome,
            status,
            getattr(client, "client_id", None),
            key,
            versions,
            state.get("audit_items", 1),
            state.get("request_id"),
            state.get("to_key") if event == "rewrap" else None,
            detail,
            state.get("audit_values", ()),
            method,
            path,
        ),
    )


def open_audit_trail(
    settings: Settings, manager: KeyManager, on_failure: Callable[[int], None]
) -> Audit:
    """The audit trail of this server worker in ``settings.audit_log`` (its own stream)."""
    address = settings.audit_syslog_address()
    if settings.keyring_read_only and not all(
        name in manager.keyring.internal for name in (SIGNING_KEY, HMAC_KEY)
    ):
        raise ValueError(
            "CRYPTD_AUDIT_LOG needs the keyring's audit keys and this keyring is read-only:"
            " create them once with `cryptd audit init` (then ship the keyring as usual)"
        )
    return Audit.to_file(
        settings.audit_log,
        manager,
        index=settings.worker_index,
        fail_closed=settings.audit_fail_closed_value(),
        hash_key_names=settings.audit_hmac_key_names,
        checkpoint_every=settings.audit_checkpoint_records,
        checkpoint_interval=settings.audit_checkpoint_interval,
        max_bytes=settings.audit_max_bytes,
        on_failure=on_failure,
        secondary=None if address is None else SyslogSink(*address),
        signing_key_type=settings.audit_signing_key_type,
        group_delay=settings.audit_group_delay_ms / 1000,
    )


def audit_readiness(audit: Audit) -> tuple[bool, dict[str, Any]]:
    """Not ready while records cannot be written, with the reason; a checkpoint that could
    not be signed leaves the service ready but degraded (records are still chained)."""
    detail: dict[str, Any] = {"enabled": audit.enabled, "fail_closed": audit.fail_closed}
    trail = audit.trail
    if trail is not None:
        detail["file"] = trail.path
        detail["write_failures"] = trail.failures
        if trail.signing_error is not None:
            detail["degraded"] = f"audit: {trail.signing_error}"
    reason = audit.reason()
    if reason is not None:
        detail["reason"] = f"audit: {reason}"
    return reason is None, detail
