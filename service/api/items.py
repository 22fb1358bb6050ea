"""The crypto operations' request bodies as engine items: ``PARSERS[op](json_object)``.

The usual bodies (plain encrypt and decrypt fields, a sign request holding its message alone)
are read without building the pydantic model; anything else goes through the model
(schemas.py) for its answer. Batch items are parsed one by one, so one malformed item becomes
that item's error instead of failing the batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.api.schemas import (
    DatakeyRequest,
    DecapsulateRequest,
    DecryptRequest,
    EncapsulateRequest,
    EncryptRequest,
    HmacRequest,
    RewrapRequest,
    SignRequest,
    VerifyRequest,
    decode_b64,
    validate,
)
from service.crypto.base import NO_OPTIONS, SignOptions
from service.errors import InvalidRequest, SchemaError
from service.operations import (
    DatakeyItem,
    DecapsulateItem,
    DecryptItem,
    EncapsulateItem,
    EncryptItem,
    HmacItem,
    Item,
    MacVerifyItem,
    OpName,
    RewrapItem,
    SignItem,
    VerifyItem,
)

MAX_SIGNER_ID_BYTES = 255
MAX_SIGNING_CONTEXT_BYTES = 255  # FIPS 204: ctx is at most 255 bytes


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
    if (
        body.algorithm is None
        and body.encoding is None
        and body.signer_id is None
        and body.hash_algorithm is None
        and body.context is None
        and body.message_type is None
    ):
        return NO_OPTIONS  # the usual request: the shared empty options, nothing built
    signer_id = None
    if body.signer_id is not None:
        signer_id = body.signer_id.encode("utf-8")
        if len(signer_id) > MAX_SIGNER_ID_BYTES:
            raise InvalidRequest("signer_id must be at most 255 bytes of UTF-8")
    context = None
    if body.context is not None:
        context = decode_b64(body.context, "context")
        if len(context) > MAX_SIGNING_CONTEXT_BYTES:
            raise InvalidRequest("context must be at most 255 bytes")
    return SignOptions(
        algorithm=body.algorithm,
        encoding=body.encoding,
        signer_id=signer_id,
        hash_algorithm=body.hash_algorithm,
        context=context,
        message_type=body.message_type,
    )


_NONE = type(None)
# The fields of the models below and the exact types strict validation passes through unchanged
# (the required field first): a body holding only these is taken without building the model,
# which cost more than the rest of parsing. Anything else (a float version, a wrong type, an
# unknown or missing field) goes through pydantic, for its answer. tests/test_schemas.py holds
# the tables to the models.
ENCRYPT_FIELDS: dict[str, tuple[type, ...]] = {
    "plaintext": (str,),
    "aad": (str, _NONE),
    "key_version": (int, _NONE),
    "context": (str, _NONE),
}
DECRYPT_FIELDS: dict[str, tuple[type, ...]] = {
    "ciphertext": (str,),
    "aad": (str, _NONE),
    "format": (str, _NONE),
    "key_version": (int, _NONE),
    "context": (str, _NONE),
}


def plain(data: dict[str, Any], fields: dict[str, tuple[type, ...]], required: str) -> bool:
    """Whether ``data`` holds ``required`` and otherwise only ``fields``, each value of exactly
    one of its types (``type() in``: a bool is not an int here, as strict validation has it)."""
    if required not in data:
        return False
    for name, value in data.items():
        types = fields.get(name)
        if types is None or type(value) not in types:
            return False
    return True


def _encrypt(data: Any) -> EncryptItem:
    if plain(data, ENCRYPT_FIELDS, "plaintext"):
        return EncryptItem(
            decode_b64(data["plaintext"], "plaintext"),
            _aad(data.get("aad")),
            data.get("key_version"),
            _context(data.get("context")),
        )
    body = validate(EncryptRequest, data)
    return EncryptItem(
        decode_b64(body.plaintext, "plaintext"),
        _aad(body.aad),
        body.key_version,
        _context(body.context),
    )


def _decrypt(data: Any) -> DecryptItem:
    if plain(data, DECRYPT_FIELDS, "ciphertext"):
        return DecryptItem(
            data["ciphertext"],
            _aad(data.get("aad")),
            data.get("format"),
            data.get("key_version"),
            _context(data.get("context")),
        )
    body = validate(DecryptRequest, data)
    return DecryptItem(
        body.ciphertext, _aad(body.aad), body.format, body.key_version, _context(body.context)
    )


def _sign(data: Any) -> SignItem:
    message = data.get("message")
    if type(message) is str and len(data) == 1:
        # The usual body, {"message": ...} alone: what the model accepts and yields for it,
        # without building the model.
        return SignItem(decode_b64(message, "message"))
    body = validate(SignRequest, data)
    payload, prehashed = _message_or_digest(body)
    return SignItem(payload, prehashed, _sign_options(body), body.key_version)


_SIGNATURE_ONLY = (
    "digest",
    "algorithm",
    "signer_id",
    "encoding",
    "hash_algorithm",
    "message_type",
)


def _verify(data: Any) -> VerifyItem | MacVerifyItem:
    body = validate(VerifyRequest, data)
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
    payload, prehashed = _message_or_digest(body)
    signature = decode_b64(body.signature, "signature")
    return VerifyItem(signature, payload, prehashed, _sign_options(body), body.key_version)


def _rewrap(data: Any) -> RewrapItem:
    body = validate(RewrapRequest, data)
    return RewrapItem(body.ciphertext, _aad(body.aad), body.to_key, _context(body.context))


def _datakey(data: Any) -> DatakeyItem:
    body = validate(DatakeyRequest, data)
    return DatakeyItem(body.bits, _aad(body.aad), body.plaintext, _context(body.context))


def _hmac(data: Any) -> HmacItem:
    body = validate(HmacRequest, data)
    return HmacItem(decode_b64(body.message, "message"), body.key_version, _context(body.context))


def _encapsulate(data: Any) -> EncapsulateItem:
    validate(EncapsulateRequest, data)
    return EncapsulateItem()


def _decapsulate(data: Any) -> DecapsulateItem:
    body = validate(DecapsulateRequest, data)
    return DecapsulateItem(decode_b64(body.ciphertext, "ciphertext"), body.key_version)


PARSERS: dict[OpName, Callable[[Any], Item]] = {
    "encrypt": _encrypt,
    "decrypt": _decrypt,
    "sign": _sign,
    "verify": _verify,
    "rewrap": _rewrap,
    "datakey": _datakey,
    "hmac": _hmac,
    "encapsulate": _encapsulate,
    "decapsulate": _decapsulate,
}
