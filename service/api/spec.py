"""The API's one declaration: every route, its request body, its answers and the error codes
it can give. The OpenAPI document (``/openapi.json``, ``docs/openapi.json``) is built from this
table alone (service/api/openapi.py); a test fails when a FastAPI route is missing here or when
the committed document differs from the generated one.

To add a route: register it in its router as usual, then add one ``Route(...)`` line to
``ROUTES`` below: method, path, operation id, summary, request model (a pydantic model, or
None), success answers ``{status: model | None}``, and the error codes it can give (start
from ``SIGNED``, ``KEYED`` or ``MANAGE``, add ``BODY`` for a JSON body, then its own).
``batch=True`` declares the ``{"batch": [...]}`` forms of the request and the answer too.
A new error code goes into ``service.api.errors.STATUS`` (its status) and ``ERROR_CODES`` here
(when it happens); a code every signed route can give goes into ``SIGNED``. Then regenerate:

    python -m service.api.openapi --write      # docs/openapi.json
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from service.api import responses as r
from service.api import schemas as s

# code -> when it happens (the response descriptions list these per status).
ERROR_CODES: Mapping[str, str] = {
    "invalid_request": "malformed JSON, bad base64, wrong JSON types, bad key name (also "
    "percent-encoded: %2F is 400), an option or operation the key type does not support, a "
    "version below 1, above 4294967295 or below min_decryption_version, an empty batch; "
    "malformed HTTP (request line, header syntax, chunked framing: the connection is closed)",
    "decryption_failed": "any decryption failure (one message for every cause: no oracle)",
    "unauthenticated": "missing, malformed, stale, future, replayed or wrong request "
    "signature, or a body that does not match Content-Digest (one message for every cause)",
    "forbidden": "the client's policy does not allow this operation on this key",
    "key_not_found": "unknown key or key version",
    "not_found": "no such route",
    "method_not_allowed": "a known route called with another method (with Allow); not "
    "listed per operation",
    "conflict": "the key exists already (pending deletion included); deleting a key without "
    "deletion_allowed; cancelling a deletion that is not scheduled; a read-only keyring",
    "key_disabled": "the key's state refuses the operation (the message names both): "
    "decrypt_only refuses encrypt, sign, hmac, datakey and rewrap to it; disabled refuses "
    "every operation; pending_deletion every operation and key change but cancel-deletion",
    "payload_too_large": "body over the body limit, or a batch over the item limit or over "
    "its key type's limit (what can finish within the deadline; the message names it)",
    "unsupported_media_type": "an authenticated request whose body is not sent as "
    "application/json (parameters allowed; a charset other than UTF-8 is not)",
    "headers_too_large": "request line and header fields over the header limit (the "
    "connection is closed)",
    "request_timeout": "the request head, or the whole request, did not arrive in time (the "
    "connection is closed)",
    "schema": "a missing or unknown field (code invalid_request)",
    "rate_limited": "the client's rate limit (see Retry-After)",
    "overloaded": "the work queue is full, the event loop runs late, or the replay store is "
    "unavailable (see Retry-After)",
    "keystore_unavailable": "the key store cannot be verified, read or written: key "
    "management is refused, crypto keeps serving from memory",
    "sealed": "an operation that needs the seal while it is unavailable (the message says "
    "what to do); crypto keeps serving from the master key in memory",
    "audit_unavailable": "the request's audit record could not be made durable and the audit "
    "fails closed (CRYPTD_AUDIT_FAIL_CLOSED): nothing is answered without one (see Retry-After)",
    "internal": "an unexpected failure; never a stack trace, key or plaintext",
}

# The HTTP edge answers these on any route, before the app (service/edge/protocol.py).
ANY: tuple[str, ...] = ("internal", "headers_too_large", "request_timeout")
# Every signed /v1/ request: the edge (signature, replay, rate limit, body limit, load shedding).
SIGNED: tuple[str, ...] = (
    *ANY,
    "invalid_request",
    "unauthenticated",
    "payload_too_large",
    "rate_limited",
    "overloaded",
    "audit_unavailable",
)
# A route with a {key} segment: the name is checked, the policy applied, the key looked up.
KEYED: tuple[str, ...] = (*SIGNED, "forbidden", "key_not_found", "not_found")
# A route with a JSON body: schema validation (422).
BODY: tuple[str, ...] = ("schema", "unsupported_media_type")
# Key management (admin): it writes the key store.
MANAGE: tuple[str, ...] = (*KEYED, "conflict", "keystore_unavailable")

_APPROVAL = (
    " With the operation in CRYPTD_APPROVALS: 202 and an approval instead, nothing "
    "done; repeated with X-Approval-ID once another admin approved it (403 forbidden: "
    "another client; 400: another request; 409 conflict: pending, used, rejected or "
    "expired; 404 not_found: no such approval)."
)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    operation_id: str
    summary: str
    request: type[BaseModel] | None
    answers: Mapping[int, type[BaseModel] | None]
    errors: tuple[str, ...]
    batch: bool = False
    signed: bool = True
    tag: str = "crypto"
    description: str = ""
    media_type: str = "application/json"

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.errors))


def _crypto(
    op: str,
    summary: str,
    request: type[BaseModel],
    answer: type[BaseModel],
    *extra: str,
    batch: bool = True,
) -> Route:
    return Route(
        "POST",
        f"/v1/{op}/{{key}}",
        op,
        summary,
        request,
        {200: answer},
        (*KEYED, *BODY, "key_disabled", *extra),
        batch=batch,
    )


ROUTES: tuple[Route, ...] = (
    # crypto
    _crypto("encrypt", "Encrypt with a named key", s.EncryptRequest, r.EncryptResponse),
    _crypto(
        "decrypt",
        "Decrypt a token, or ciphertext made outside cryptd",
        s.DecryptRequest,
        r.DecryptResponse,
        "decryption_failed",
    ),
    _crypto("sign", "Sign a message or a digest", s.SignRequest, r.SignResponse),
    _crypto(
        "verify", "Verify a signature, or an HMAC tag", s.VerifyRequest, r.VerifyResponse
    ),
    _crypto(
        "rewrap",
        "Re-encrypt under the latest version or another key (plaintext stays inside)",
        s.RewrapRequest,
        r.EncryptResponse,
        "decryption_failed",
    ),
    _crypto(
        "datakey", "A fresh data key, and the same key wrapped", s.DatakeyRequest, r.DatakeyResponse
    ),
    _crypto("hmac", "HMAC of a message (HMAC keys)", s.HmacRequest, r.HmacResponse),
    _crypto(
        "encapsulate",
        "A fresh shared secret and its KEM ciphertext (ML-KEM and X-Wing keys)",
        s.EncapsulateRequest,
        r.EncapsulateResponse,
    ),
    _crypto(
        "decapsulate",
        "The shared secret of a KEM ciphertext (ML-KEM and X-Wing keys)",
        s.DecapsulateRequest,
        r.DecapsulateResponse,
    ),
    Route("POST", "/v1/random", "random", "Random bytes from the OS CSPRNG", s.RandomRequest,
          {200: r.RandomResponse}, (*SIGNED, "forbidden", *BODY)),
    # keys
    Route("GET", "/v1/keys", "list_keys", "Keys this client may read", None, {200: r.KeyList},
          SIGNED, tag="keys"),
    Route("GET", "/v1/keys/{key}", "get_key",
          "A key's metadata, public keys and usage per version", None,
          {200: r.KeyDescription}, KEYED, tag="keys"),
    Route("POST", "/v1/keys/{key}", "create_key", "Create a key (admin)", s.CreateKeyRequest,
          {201: r.KeyMetadata}, (*MANAGE, *BODY), tag="keys"),
    Route("PATCH", "/v1/keys/{key}", "update_key", "Change a key's settings (admin)",
          s.UpdateKeyRequest, {200: r.KeyMetadata, 202: r.Approval},
          (*MANAGE, *BODY, "key_disabled"), tag="keys",
          description="From disabled to enabled is the operation 'enable'." + _APPROVAL),
    Route("DELETE", "/v1/keys/{key}", "delete_key", "Delete a key (admin)", None,
          {204: None, 202: r.DeletionAccepted}, (*MANAGE, "key_disabled"), tag="keys",
          description="204: deleted. 202: with CRYPTD_DELETION_WAITING_PERIOD above 0, "
          "scheduled: the key is pending_deletion until deletion_date, refuses every "
          "operation meanwhile, and is destroyed after it." + _APPROVAL),
    Route("POST", "/v1/keys/{key}/cancel-deletion", "cancel_key_deletion",
          "Undo a scheduled deletion; the key gets back the state it had (admin)", None,
          {200: r.KeyMetadata}, MANAGE, tag="keys"),
    Route("POST", "/v1/keys/{key}/rotate", "rotate_key", "Add a version (admin)", None,
          {200: r.KeyMetadata}, (*MANAGE, "key_disabled"), tag="keys"),
    Route("GET", "/v1/keys/wrapping-key", "get_wrapping_key",
          "The RSA-4096 public key that wraps imported key material (admin)", None,
          {200: r.WrappingKeyResponse}, MANAGE, tag="keys"),
    Route("POST", "/v1/keys/{key}/import", "import_key",
          "Create a key from wrapped material (admin)", s.ImportKeyRequest,
          {201: r.KeyMetadata, 202: r.Approval}, (*MANAGE, *BODY), tag="keys",
          description=_APPROVAL.strip()),
    Route("POST", "/v1/keys/{key}/import-version", "import_key_version",
          "Add a version from wrapped material (admin)", s.ImportVersionRequest,
          {200: r.KeyMetadata}, (*MANAGE, *BODY, "key_disabled"), tag="keys"),
    Route("GET", "/v1/keys/{key}/backup", "backup_key",
          "The key, every version and its metadata, in one blob (admin)", None,
          {200: r.BackupResponse, 202: r.Approval}, (*MANAGE, "key_disabled"), tag="keys",
          description=_APPROVAL.strip()),
    Route("POST", "/v1/keys/{key}/restore", "restore_key",
          "Restore a backup into a cryptd holding the same master key (admin)",
          s.RestoreKeyRequest, {201: r.KeyMetadata, 202: r.Approval}, (*MANAGE, *BODY),
          tag="keys", description=_APPROVAL.strip()),
    # dual control
    Route("GET", "/v1/approvals/{approval_id}", "get_approval",
          "An approval: the request it holds, who asked, its state (admin)", None,
          {200: r.Approval}, (*SIGNED, "forbidden", "not_found", "keystore_unavailable"),
          tag="approvals"),
    Route("POST", "/v1/approvals/{approval_id}/approve", "approve",
          "Approve another admin's held request (admin, not its requester)", None,
          {200: r.Approval}, (*SIGNED, "forbidden", "not_found", "conflict",
                              "keystore_unavailable"), tag="approvals"),
    Route("POST", "/v1/approvals/{approval_id}/reject", "reject",
          "Reject a held request, or revoke an approval not carried out yet (admin; its "
          "requester may withdraw it)", None,
          {200: r.Approval}, (*SIGNED, "forbidden", "not_found", "conflict",
                              "keystore_unavailable"), tag="approvals"),
    # health (unsigned)
    Route("GET", "/healthz", "healthz", "Liveness", None, {200: r.Health}, ANY, signed=False,
          tag="health"),
    Route("GET", "/readyz", "readyz", "Readiness", None, {200: r.Readiness, 503: r.Readiness},
          ANY, signed=False, tag="health",
          description="503 (same body) while a check fails."),
    Route("GET", "/v1/sys/seal-status", "seal_status", "Seal status", None,
          {200: r.SealStatus}, ANY, signed=False, tag="seal",
          description="Unsigned, like /readyz."),
    Route("POST", "/v1/sys/unseal", "unseal",
          "Submit one Shamir unseal share to this server worker (admin)", s.UnsealRequest,
          {200: r.SealStatus}, (*SIGNED, *BODY, "forbidden", "sealed"), tag="seal",
          description="A refused share (malformed, altered, of another split, repeated) is 400 "
          "and leaves the progress as it was. On a server that holds its master key: the "
          "status, nothing else."),
    Route("POST", "/v1/sys/rotate-master-key", "rotate_master_key",
          "Rotate the master key and rewrap every key version under it (admin)", None,
          {200: r.MasterKeyRotation},
          (*SIGNED, "forbidden", "conflict", "keystore_unavailable", "sealed"), tag="seal",
          description="Online: crypto keeps serving, every worker moves to the new key. "
          "Static seal with CRYPTD_MASTER_KEY_FILE, pkcs11 or transit (409 otherwise, or "
          "while another rotation runs; 503 with Retry-After while the token or Transit "
          "service is unavailable). Body: none or {}. docs/DEPLOY.md, Rotating the master key."),
    Route("GET", "/metrics", "metrics", "Prometheus text exposition", None, {200: None}, ANY,
          signed=False, tag="health", media_type="text/plain"),
)  # fmt: skip


def _template(path: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"\\{[a-z_]+\\}", "[^/]+", re.escape(path)) + "$")


_TEMPLATES = [(_template(route.path), route.method) for route in ROUTES]


def allowed_methods(path: str) -> list[str]:
    """The methods declared for a concrete path (with HEAD where GET is), sorted. A path
    declared literally (``/v1/keys/wrapping-key``) is its own resource: a template it also
    matches (``/v1/keys/{key}``) does not add methods to it."""
    methods = {route.method for route in ROUTES if route.path == path} or {
        method for template, method in _TEMPLATES if template.match(path)
    }
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)
