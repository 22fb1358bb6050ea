"""Request bodies: pydantic models (schema checks answer 422) and their conversion to engine
items (semantic checks such as base64 answer 400). Batch items are parsed one by one, so one
malformed item becomes that item's error instead of failing the batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from service import b64
from service.crypto.base import SignOptions
from service.engine import (
    DatakeyItem,
    DecryptItem,
    EncryptItem,
    HmacItem,
    Item,
    MacVerifyItem,
    OpName,
    RewrapItem,
    SignItem,
    VerifyItem,
)
from service.errors import InvalidRequest, SchemaError

MAX_SIGNER_ID_BYTES = 255
MAX_RANDOM_BYTES = 65536
M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class EncryptRequest(_Body):
    plaintext: str
    aad: str | None = None
    key_version: int | None = None
    context: str | None = None


class DecryptRequest(_Body):
    ciphertext: str
    aad: str | None = None
    format: str | None = None
    key_version: int | None = None
    context: str | None = None


class SignRequest(_Body):
    message: str | None = None
    digest: str | None = None
    algorithm: str | None = None
    signer_id: str | None = None
    encoding: str | None = None
    hash_algorithm: str | None = None
    key_version: int | None = None


class VerifyRequest(SignRequest):
    """A signature (signing keys) or a MAC (HMAC keys, with ``message`` and ``context`` if
    derived): exactly one of ``signature`` and ``mac``."""

    signature: str | None = None
    mac: str | None = None
    context: str | None = None


class RewrapRequest(_Body):
    ciphertext: str
    aad: str | None = None
    to_key: str | None = None
    context: str | None = None


class DatakeyRequest(_Body):
    bits: int = 256
    aad: str | None = None
    plaintext: bool = True
    context: str | None = None


class HmacRequest(_Body):
    message: str
    key_version: int | None = None
    context: str | None = None


class RandomRequest(_Body):
    bytes: int


class CreateKeyRequest(_Body):
    type: str
    deletion_allowed: bool = False
    derived: bool = False
    convergent: bool = False


class UpdateKeyRequest(BaseModel):
    # Unknown fields are ignored so that "no known field" can be told apart (400).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    min_decryption_version: int | None = None
    deletion_allowed: bool | None = None


def decode_b64(value: str, field: str) -> bytes:
    try:
        return b64.decode(value)
    except ValueError:
        raise InvalidRequest(f"'{field}' is not valid base64 (RFC 4648, padded)") from None


def _aad(value: str | None) -> bytes:
    return b"" if value is None else decode_b64(value, "aad")


def _context(value: str | None) -> bytes | None:
    return None if value is None else decode_b64(value, "context")


def _message_or_digest(body: SignRequest) -> tuple[bytes, bool]:
    if (body.message is None) == (body.digest is None):
        raise InvalidRequest("send exactly one of 'message' or 'digest'")
    if body.message is not None:
        return decode_b64(body.message, "message"), False
    assert body.digest is not None
    return decode_b64(body.digest, "digest"), True


def _sign_options(body: SignRequest) -> SignOptions:
    signer_id = None
    if body.signer_id is not None:
        signer_id = body.signer_id.encode("utf-8")
        if len(signer_id) > MAX_SIGNER_ID_BYTES:
            raise InvalidRequest("signer_id must be at most 255 bytes of UTF-8")
    return SignOptions(
        algorithm=body.algorithm,
        encoding=body.encoding,
        signer_id=signer_id,
        hash_algorithm=body.hash_algorithm,
    )


def _validate(model: type[M], data: Any) -> M:
    """Wrong JSON types are 400 (the contract's table); other schema failures (a missing or
    unknown field) are 422, as FastAPI answers them."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message = schema_message(exc)
        if all(error["type"].endswith("_type") for error in exc.errors()):
            raise InvalidRequest(message) from None
        raise SchemaError(message) from None


def schema_message(exc: ValidationError) -> str:
    """A short description of what failed, naming fields but never echoing values."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False)[:5]:
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def _encrypt(data: Any) -> EncryptItem:
    body = _validate(EncryptRequest, data)
    return EncryptItem(
        decode_b64(body.plaintext, "plaintext"),
        _aad(body.aad),
        body.key_version,
        _context(body.context),
    )


def _decrypt(data: Any) -> DecryptItem:
    body = _validate(DecryptRequest, data)
    return DecryptItem(
        body.ciphertext, _aad(body.aad), body.format, body.key_version, _context(body.context)
    )


def _sign(data: Any) -> SignItem:
    body = _validate(SignRequest, data)
    payload, prehashed = _message_or_digest(body)
    return SignItem(payload, prehashed, _sign_options(body), body.key_version)


_SIGNATURE_ONLY = ("digest", "algorithm", "signer_id", "encoding", "hash_algorithm")


def _verify(data: Any) -> VerifyItem | MacVerifyItem:
    body = _validate(VerifyRequest, data)
    if body.signature is not None and body.mac is not None:
        raise InvalidRequest("send 'signature' or 'mac', not both")
    if body.mac is not None:
        for name in _SIGNATURE_ONLY:
            if getattr(body, name) is not None:
                raise InvalidRequest(f"'{name}' does not apply to a MAC")
        if body.message is None:
            raise SchemaError("body.message: a MAC is verified against the 'message'")
        message = decode_b64(body.message, "message")
        return MacVerifyItem(body.mac, message, body.key_version, _context(body.context))
    if body.signature is None:
        raise SchemaError("body: send 'signature' (signing keys) or 'mac' (HMAC keys)")
    if body.context is not None:
        raise InvalidRequest("'context' applies to derived keys only; signing keys are not")
    payload, prehashed = _message_or_digest(body)
    signature = decode_b64(body.signature, "signature")
    return VerifyItem(signature, payload, prehashed, _sign_options(body), body.key_version)


def _rewrap(data: Any) -> RewrapItem:
    body = _validate(RewrapRequest, data)
    return RewrapItem(body.ciphertext, _aad(body.aad), body.to_key, _context(body.context))


def _datakey(data: Any) -> DatakeyItem:
    body = _validate(DatakeyRequest, data)
    return DatakeyItem(body.bits, _aad(body.aad), body.plaintext, _context(body.context))


def _hmac(data: Any) -> HmacItem:
    body = _validate(HmacRequest, data)
    return HmacItem(decode_b64(body.message, "message"), body.key_version, _context(body.context))


def random_size(body: RandomRequest) -> int:
    if not 1 <= body.bytes <= MAX_RANDOM_BYTES:
        raise InvalidRequest(f"bytes must be between 1 and {MAX_RANDOM_BYTES}")
    return body.bytes


PARSERS: dict[OpName, Callable[[Any], Item]] = {
    "encrypt": _encrypt,
    "decrypt": _decrypt,
    "sign": _sign,
    "verify": _verify,
    "rewrap": _rewrap,
    "datakey": _datakey,
    "hmac": _hmac,
}

MODELS: dict[OpName, type[BaseModel]] = {
    "encrypt": EncryptRequest,
    "decrypt": DecryptRequest,
    "sign": SignRequest,
    "verify": VerifyRequest,
    "rewrap": RewrapRequest,
    "datakey": DatakeyRequest,
    "hmac": HmacRequest,
}


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; malformed JSON or another JSON type is 400."""
    if not body:
        raise InvalidRequest("request body must be a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("malformed JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def parse_model(model: type[M], body: bytes) -> M:
    return _validate(model, parse_json_object(body))
