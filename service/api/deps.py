"""What routes need from the application: the runner, the key manager, the caller's identity.

Routes reach services through ``request.app.state.services`` (built by create_app), never
through module globals."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from service.auth import policy
from service.keys.manager import KeyManager
from service.keys.propagation import Propagation
from service.logs import Audit
from service.runner import CryptoRunner
from service.usage.recorder import UsageRecorder


class ReadinessCheck(Protocol):
    async def __call__(self) -> tuple[bool, dict[str, Any]]: ...


@dataclass
class Services:
    keys: KeyManager
    runner: CryptoRunner
    usage: UsageRecorder
    max_batch_items: int
    readiness: list[tuple[str, ReadinessCheck]]
    audit: Audit
    # propagate(generation): wait for the other replicas to enforce it; what they confirmed.
    propagate: Callable[[int], Awaitable[Propagation]]


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


def authorize(request: Request, key: str, operation: str) -> None:
    """403 unless the authenticated client's policy allows ``operation`` on ``key``."""
    policy.authorize(policy.client_from_scope(request.scope), key, operation)


def authorize_keyless(request: Request, operation: str) -> None:
    """403 unless a rule of the client's policy lists ``operation`` (one that names no key)."""
    policy.authorize_keyless(policy.client_from_scope(request.scope), operation)


def require_admin(request: Request) -> None:
    policy.require_admin(policy.client_from_scope(request.scope))


def may_read(request: Request, key: str) -> bool:
    return policy.client_from_scope(request.scope).allows(key, "read")


def client_id(request: Request) -> str | None:
    client = request.scope.get("state", {}).get(policy.STATE_KEY)
    return getattr(client, "client_id", None)


def note(request: Request, **fields: object) -> None:
    """Record request-scoped fields (key, operation, version) for the access and audit logs."""
    request.scope.setdefault("state", {}).update(fields)
