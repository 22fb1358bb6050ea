"""Client policies applied to a request: which authenticated client sent it, and may it act.

The authenticator (service/auth/authenticator.py) puts the client in ``scope["state"]``; the
routes call these checks once they know the key and the operation, so a refusal is 403 after
the body was parsed as far as naming the key."""

from __future__ import annotations

from service.asgi import Scope, route_path
from service.auth.clients import Client
from service.errors import Forbidden, Unauthenticated

STATE_KEY = "client"
PROTECTED_PREFIX = "/v1/"


def is_protected(scope: Scope) -> bool:
    """Whether a request must be authenticated: the API's paths (``/v1/``)."""
    # Mounted under a prefix: judge the app's own path.
    return route_path(scope).startswith(PROTECTED_PREFIX)


def set_client(scope: Scope, client: Client) -> None:
    """Name ``client`` as the sender of this request (``request.state.client``)."""
    state = scope.get("state")
    if state is None:
        scope["state"] = {STATE_KEY: client}
    else:
        state[STATE_KEY] = client


def client_from_scope(scope: Scope) -> Client:
    """The authenticated client of this request (``request.state.client``)."""
    client = scope.get("state", {}).get(STATE_KEY)
    if not isinstance(client, Client):
        # The authenticator did not run for this route: refuse rather than run unauthenticated.
        raise Unauthenticated()
    return client


def authorize(client: Client, key: str, operation: str) -> None:
    """Raise :class:`~service.errors.Forbidden` unless ``client`` may ``operation`` on ``key``."""
    if not client.allows(key, operation):
        raise Forbidden()


def authorize_keyless(client: Client, operation: str) -> None:
    """Raise :class:`~service.errors.Forbidden` unless ``client`` may ``operation``, one that
    names no key (``random``)."""
    if not client.allows_keyless(operation):
        raise Forbidden()


def require_admin(client: Client) -> None:
    """Raise :class:`~service.errors.Forbidden` unless ``client`` may manage keys."""
    if not client.admin:
        raise Forbidden()
