"""Dual control: operations that need a second admin client, and the approvals that let them run.

``CRYPTD_APPROVALS`` names operations (:data:`OPERATIONS`). The first call of one records a
pending approval bound to that exact request (method, path and a SHA-256 digest of the body:
an import's wrapped material is never kept) and to the client that made it; another admin
client approves or rejects it; the requester then repeats the request with ``X-Approval-ID``
and the approval is spent in the same store transaction that checks it, so it runs once.

Approvals live in the keyring document (``approvals``, beside ``keys``): every replica and
worker shares them through the key store's transaction (file lock or PostgreSQL row lock),
and the document MAC covers them, so an approval cannot be forged or revived by editing the
store without the master key. This module holds the records and their transitions over that
mapping; it does no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from service.defaults import APPROVAL_OPERATIONS, DEFAULT_APPROVAL_TTL
from service.errors import Conflict, CryptdError, Forbidden, InvalidRequest

OPERATIONS = APPROVAL_OPERATIONS
DEFAULT_TTL = DEFAULT_APPROVAL_TTL
HEADER = "X-Approval-ID"

PENDING = "pending"
APPROVED = "approved"
REJECTED = "rejected"
USED = "used"
EXPIRED = "expired"  # shown, never stored: a pending or approved one past expires_at
STATES = (PENDING, APPROVED, REJECTED, USED)

# Decided, used and expired approvals stay this long after they expire, so a replay is told
# 409 (used, rejected, expired) rather than 404; then they leave the document.
RETENTION = 86400
# Open approvals at once: the document stays small whatever a (compromised) admin asks for.
MAX_OPEN = 256

_ID_BYTES = 16


class ApprovalNotFound(CryptdError):
    code = "not_found"
    default_message = "no such approval (unknown, or older than a day past its expiry)"


def binding(method: str, path: str, body: bytes) -> str:
    """What an approval is bound to: the method, the path with its query, the body's digest.
    Length-prefixed so no two requests share one input."""
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), hashlib.sha256(body).digest()):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


@dataclass
class Approval:
    operation: str
    key: str | None
    method: str
    path: str
    binding: str
    requested_by: str
    requested_at: int
    expires_at: int
    state: str = PENDING
    decided_by: str | None = None
    decided_at: int | None = None
    used_at: int | None = None
    extra: dict[str, str] = field(default_factory=dict)  # what the request will do, for people

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Approval:
        """Strict: a field of the wrong type or an unknown one is refused (ValueError)."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: an approval must be an object")
        expected = {
            "operation": (str,),
            "key": (str, type(None)),
            "method": (str,),
            "path": (str,),
            "binding": (str,),
            "requested_by": (str,),
            "requested_at": (int,),
            "expires_at": (int,),
            "state": (str,),
            "decided_by": (str, type(None)),
            "decided_at": (int, type(None)),
            "used_at": (int, type(None)),
            "extra": (dict,),
        }
        if set(raw) != set(expected):
            raise ValueError(f"{where}: an approval needs exactly {', '.join(sorted(expected))}")
        for name, kinds in expected.items():
            if type(raw[name]) not in kinds:
                raise ValueError(f"{where}: {name} has the wrong type")
        if raw["operation"] not in OPERATIONS or raw["state"] not in STATES:
            raise ValueError(f"{where}: unknown operation or state")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in raw["extra"].items()):
            raise ValueError(f"{where}: extra must map strings to strings")
        return cls(**raw)

    def state_at(self, now: float) -> str:
        if self.state in (PENDING, APPROVED) and now >= self.expires_at:
            return EXPIRED
        return self.state

    def view(self, approval_id: str, now: float) -> dict[str, Any]:
        """The API's view: everything but the binding digest."""
        return {
            "approval_id": approval_id,
            "operation": self.operation,
            "key": self.key,
            "expires_at": _rfc3339(self.expires_at),
            "state": self.state_at(now),
            "method": self.method,
            "path": self.path,
            "requested_by": self.requested_by,
            "requested_at": _rfc3339(self.requested_at),
            "decided_by": self.decided_by,
            "decided_at": None if self.decided_at is None else _rfc3339(self.decided_at),
            "used_at": None if self.used_at is None else _rfc3339(self.used_at),
            **({"details": dict(self.extra)} if self.extra else {}),
        }


def _rfc3339(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def check_id(approval_id: str) -> None:
    """Our ids are 32 lowercase hex digits; anything else is 400 before the store is read."""
    if len(approval_id) != 2 * _ID_BYTES or any(c not in "0123456789abcdef" for c in approval_id):
        raise InvalidRequest(f"{HEADER} / approval id must be 32 lowercase hex digits")


def prune(approvals: dict[str, Approval], now: float) -> None:
    for approval_id in [a for a, v in approvals.items() if now >= v.expires_at + RETENTION]:
        del approvals[approval_id]


def request(
    approvals: dict[str, Approval],
    *,
    operation: str,
    key: str | None,
    method: str,
    path: str,
    body: bytes,
    client: str,
    ttl: int,
    now: float,
    extra: dict[str, str] | None = None,
) -> tuple[str, Approval]:
    """Record a pending approval for this request; its id and record."""
    prune(approvals, now)
    open_ = sum(1 for a in approvals.values() if a.state_at(now) in (PENDING, APPROVED))
    if open_ >= MAX_OPEN:
        raise Conflict(
            f"{MAX_OPEN} approvals are open already; approve, reject or let some expire first"
        )
    approval_id = secrets.token_hex(_ID_BYTES)
    at = int(now)
    approval = Approval(
        operation=operation,
        key=key,
        method=method.upper(),
        path=path,
        binding=binding(method, path, body),
        requested_by=client,
        requested_at=at,
        expires_at=at + ttl,
        extra=dict(extra or {}),
    )
    approvals[approval_id] = approval
    return approval_id, approval


def _found(approvals: dict[str, Approval], approval_id: str) -> Approval:
    check_id(approval_id)
    found = approvals.get(approval_id)
    if found is None:
        raise ApprovalNotFound()
    return found


def _not_spent(approval: Approval, now: float) -> None:
    state = approval.state_at(now)
    if state == USED:
        raise Conflict("this approval was used already; request the operation again")
    if state == REJECTED:
        raise Conflict(f"this approval was rejected by {approval.decided_by}")
    if state == EXPIRED:
        raise Conflict("this approval has expired; request the operation again")


def decide(
    approvals: dict[str, Approval], approval_id: str, client: str, *, approve: bool, now: float
) -> Approval:
    """Approve a pending approval, or reject one not carried out yet (approved included: a
    revocation). The requester may withdraw (reject) its own request, never approve it."""
    approval = _found(approvals, approval_id)
    if approve and hmac.compare_digest(approval.requested_by, client):
        raise Forbidden("the client that requested an operation cannot approve it")
    _not_spent(approval, now)
    if approve and approval.state != PENDING:
        raise Conflict(f"this approval was {approval.state} already by {approval.decided_by}")
    approval.state = APPROVED if approve else REJECTED
    approval.decided_by = client
    approval.decided_at = int(now)
    return approval


def claim(
    approvals: dict[str, Approval],
    approval_id: str,
    *,
    client: str,
    operation: str,
    method: str,
    path: str,
    body: bytes,
    now: float,
) -> Approval:
    """Spend an approval for this request (in the caller's store transaction, so once).

    403 for any client but the requester; 400 when it was given for another request; 409
    while pending, and once used, rejected or expired."""
    approval = _found(approvals, approval_id)
    if not hmac.compare_digest(approval.requested_by, client):
        raise Forbidden("only the client that requested this operation may carry it out")
    if not hmac.compare_digest(approval.binding, binding(method, path, body)):
        raise InvalidRequest(
            f"this approval is for {approval.method} {approval.path} with its own body: repeat "
            "the approved request exactly"
        )
    _not_spent(approval, now)
    if approval.operation != operation:  # the same request, but the key changed meanwhile
        raise InvalidRequest(
            f"this approval is for a {approval.operation}, which this request no longer is"
        )
    if approval.state != APPROVED:
        raise Conflict("this approval is still pending: another admin must approve it first")
    approval.state = USED
    approval.used_at = int(now)
    return approval


def release(approvals: dict[str, Approval], approval_id: str, client: str) -> None:
    """Give back an approval whose request was refused without changing anything (a key that
    does not allow deletion, a backup that does not load): it may be carried out again."""
    approval = approvals.get(approval_id)
    if approval is not None and approval.state == USED and approval.requested_by == client:
        approval.state = APPROVED
        approval.used_at = None
