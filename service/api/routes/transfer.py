"""Key material in and out, admin only: the import wrapping key, wrapped import (Vault/OpenBao
BYOK, AWS KMS ImportKeyMaterial), and the backup and restore of one key.

    GET  /v1/keys/wrapping-key         -> {public_key, type}
    POST /v1/keys/{key}/import         {type, ciphertext, ...} -> 201, metadata
    POST /v1/keys/{key}/import-version {ciphertext}            -> 200, metadata
    GET  /v1/keys/{key}/backup         -> {backup}
    POST /v1/keys/{key}/restore        {backup}                -> 201, metadata

The wrapping key is an RSA-4096 key kept in the key store, wrapped under the master key like any
other, under an internal name no user key can take; the first replica that needs it creates it
(one store transaction, so racing replicas end with one key) and every replica serves it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from service import b64
from service.api import deps
from service.api.routes.crypto import json_response
from service.api.routes.keys import create, manage, new_key
from service.api.schemas import (
    ImportKeyRequest,
    ImportVersionRequest,
    RestoreKeyRequest,
    decode_b64,
    parse_model,
)
from service.crypto import wrapping
from service.crypto.base import CryptoError
from service.crypto.registry import KEY_TYPES
from service.errors import InvalidRequest, KeyNotFound
from service.keys.keyring import Key, check_key_flags, check_key_name
from service.keys.manager import KeyManager

router = APIRouter(prefix="/v1/keys", tags=["keys"])

WRAPPING_KEY = "cryptd:wrapping-key"
WRAPPING_KEY_PATH = "wrapping-key"  # the route's segment, reserved as a user key name


def _unwrapped(manager: KeyManager, type_name: str, ciphertext: str, oaep: str | None) -> bytes:
    """The material a client wrapped for import, validated by its key type (400 otherwise)."""
    if oaep is not None and oaep != "SHA256":
        raise InvalidRequest("hash_function must be 'SHA256' (RSA-OAEP with SHA-256)")
    key_type = KEY_TYPES.get(type_name)
    if key_type is None:
        raise InvalidRequest(f"unknown key type {type_name!r}")
    if key_type.import_key is None:
        raise InvalidRequest(f"key type {type_name} does not support import")
    blob = decode_b64(ciphertext, "ciphertext")
    wrapping_key = manager.keyring.internal.get(WRAPPING_KEY)
    if wrapping_key is None and manager.reload():  # made by another replica a moment ago?
        wrapping_key = manager.keyring.internal.get(WRAPPING_KEY)
    if wrapping_key is None:
        raise InvalidRequest("no wrapping key exists yet: GET /v1/keys/wrapping-key first")
    handle = wrapping_key.version().handle
    try:
        material = wrapping.unwrap(
            lambda block: handle.decrypt_external(block, "rsa-oaep-sha256"), blob
        )
        return key_type.import_key(material)
    except CryptoError as exc:  # WrappedKeyError, InvalidKeyMaterial: say which, never bytes
        raise InvalidRequest(str(exc)) from None


@router.get("/" + WRAPPING_KEY_PATH, summary="the RSA-4096 public key that wraps imports")
async def wrapping_key(request: Request) -> Response:
    manager = deps.services(request).keys
    managed = await manage(
        request,
        "wrapping-key",
        WRAPPING_KEY_PATH,
        lambda: manager.ensure_internal_key(WRAPPING_KEY, wrapping.WRAPPING_KEY_TYPE),
    )
    pem = managed.found.version().handle.public_key_pem()
    return json_response(
        {"public_key": pem, "type": wrapping.WRAPPING_KEY_TYPE}, headers=managed.headers
    )


@router.post(
    "/{key}/import",
    status_code=201,
    summary="create a key from material wrapped with the wrapping key",
)
async def import_key(request: Request, key: str) -> Response:
    def make(manager: KeyManager, body: ImportKeyRequest) -> Key:
        if body.type in KEY_TYPES:  # flags first: refused before any unwrapping
            check_key_flags(KEY_TYPES[body.type], derived=body.derived, convergent=body.convergent)
        material = _unwrapped(manager, body.type, body.ciphertext, body.hash_function)
        return create(manager, key, body, material)

    return await new_key(request, "import", key, ImportKeyRequest, make, approval="import")


@router.post(
    "/{key}/import-version",
    summary="add a version from material wrapped with the wrapping key",
)
async def import_version(request: Request, key: str) -> Response:
    check_key_name(key)
    body = parse_model(ImportVersionRequest, await request.body())
    services = deps.services(request)
    manager = services.keys
    try:
        _, existing = await services.runner.key(key)  # finds a key made on another replica
    except KeyNotFound as exc:
        missing: KeyNotFound | None = exc
    else:
        missing = None

    def change() -> Key:
        if missing is not None:  # raised here, after the admin check, and audited
            raise missing
        material = _unwrapped(manager, existing.type.name, body.ciphertext, body.hash_function)
        return manager.rotate(key, material=material)

    rotated = await manage(request, "import-version", key, change)
    return json_response(rotated.found.metadata(), headers=rotated.headers)


@router.get("/{key}/backup", summary="the key, every version and its metadata, in one blob")
async def backup_key(request: Request, key: str) -> Response:
    manager = deps.services(request).keys
    blob: list[bytes] = []

    def change() -> Key:
        blob.append(manager.backup(key))
        return manager.keyring.key(key)

    await manage(request, "backup", key, change, changes=False, approval="backup")
    return json_response({"backup": b64.encode(blob[0])})


@router.post(
    "/{key}/restore",
    status_code=201,
    summary="restore a backup into a cryptd holding the same master key",
)
async def restore_key(request: Request, key: str) -> Response:
    return await new_key(
        request,
        "restore",
        key,
        RestoreKeyRequest,
        lambda manager, body: manager.restore(key, decode_b64(body.backup, "backup")),
        approval="restore",
    )
