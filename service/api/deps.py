"""What routes need from the application: the runner, the key manager, the caller's identity.

Routes reach services through ``request.app.state.services`` (built by create_app), never
through module globals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from service.errors import Forbidden
from service.keys.manager import KeyManager
from service.runner import CryptoRunner


class Caller(Protocol):
    """The authenticated client, as the auth middleware puts it in ``scope["state"]``."""

    id: str
    admin: bool

    def allows(self, key: str, operation: str) -> bool: ...


class ReadinessCheck(Protocol):
    async def __call__(self) -> tuple[bool, dict[str, Any]]: ...


@dataclass
class Services:
    keys: KeyManager
    runner: CryptoRunner
    max_batch_items: int
    readiness: list[tuple[str, ReadinessCheck]]


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


def caller(request: Request) -> Caller | None:
    """The authenticated client, or None when authentication is disabled (development only)."""
    found: Caller | None = request.scope.get("state", {}).get("client")
    return found


def authorize(request: Request, key: str, operation: str) -> None:
    client = caller(request)
    if client is not None and not (client.admin or client.allows(key, operation)):
        raise Forbidden()


def require_admin(request: Request) -> None:
    client = caller(request)
    if client is not None and not client.admin:
        raise Forbidden("key management requires an admin client")


def may_read(request: Request, key: str) -> bool:
    client = caller(request)
    return client is None or client.admin or client.allows(key, "read")


def note(request: Request, **fields: object) -> None:
    """Record request-scoped fields (key, operation, version) for the access and audit logs."""
    request.scope.setdefault("state", {}).update(fields)
