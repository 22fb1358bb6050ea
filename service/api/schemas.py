"""Request bodies: pydantic models (schema checks answer 422), the JSON read into them, and the
checks of values the schema only states (base64, sizes: 400). The crypto operations' bodies
become engine items in items.py."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from service import b64
from service.crypto.digests import HASHES
from service.crypto.registry import KEY_TYPES
from service.errors import InvalidRequest, SchemaError
from service.keys.keyring import SETTABLE_STATES
from service.keys.manager import MAX_AUTO_ROTATE_PERIOD

MAX_RANDOM_BYTES = 65536
M = TypeVar("M", bound=BaseModel)

# What the document states beyond the JSON types. The values are checked after parsing (400
# invalid_request, as the contract has it for bad base64, versions and options), so these are
# given to the schema only (json_schema_extra), not to pydantic's validation (which answers 422).
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
CIPHERTEXT_PATTERN = r"^cryptd:v[1-9][0-9]*:[A-Za-z0-9_-]+$"
KEY_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
SIGN_ALGORITHMS = ("pss", "pkcs1v15")
SIGNATURE_ENCODINGS = ("der", "raw")

Base64 = Annotated[
    str,
    Field(
        json_schema_extra={"pattern": BASE64_PATTERN, "contentEncoding": "base64"},
        description="Standard base64 (RFC 4648 section 4), padded.",
    ),
]
Token = Annotated[
    str,
    Field(
        json_schema_extra={"pattern": CIPHERTEXT_PATTERN},
        description="Ciphertext token: cryptd:v<version>:<base64url, no padding>.",
    ),
]
Context = Annotated[
    Base64,
    Field(description="Derived keys: the derivation context (required); other keys refuse it."),
]
KeyName = Annotated[
    str,
    Field(json_schema_extra={"pattern": KEY_NAME_PATTERN, "not": {"enum": [".", ".."]}}),
]
KeyTypeName = Annotated[str, Field(json_schema_extra={"enum": sorted(KEY_TYPES)})]


def _integral(value: Any) -> Any:
    """JSON Schema's integer includes 2.0 (a number with no fractional part): take it as 2;
    1.5 stays a wrong type."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_integral)]
VersionNumber = Annotated[Integer, Field(json_schema_extra={"minimum": 1})]
SettableState = Annotated[
    str,
    Field(
        json_schema_extra={"enum": list(SETTABLE_STATES)},
        description="enabled; decrypt_only (decrypt, verify and rewrap from the key only); "
        "disabled (everything refused). pending_deletion is set by DELETE.",
    ),
]
MinEncryptionVersion = Annotated[
    Integer,
    Field(
        json_schema_extra={"minimum": 0},
        description="Lowest version encrypt, sign, hmac, datakey and rewrap may use; 0: none. "
        "0, or from min_decryption_version to the latest version.",
    ),
]
ExternalFormat = Annotated[
    str,
    Field(
        json_schema_extra={
            "enum": sorted({f for t in KEY_TYPES.values() for f in t.external_formats})
        }
    ),
]
SignAlgorithm = Annotated[str, Field(json_schema_extra={"enum": list(SIGN_ALGORITHMS)})]
SignatureEncoding = Annotated[str, Field(json_schema_extra={"enum": list(SIGNATURE_ENCODINGS)})]
HashAlgorithm = Annotated[str, Field(json_schema_extra={"enum": list(HASHES)})]
MessageType = Annotated[
    str,
    Field(
        json_schema_extra={"enum": ["raw", "external_mu"]},
        description="ML-DSA: 'raw' (default) signs 'message'; 'external_mu' takes the 64-byte "
        "mu of FIPS 204 section 6.2 in 'message'. Composite ML-DSA keys: 'raw' only.",
    ),
]
SigningContext = Annotated[
    Base64,
    Field(
        description="ML-DSA: the FIPS 204 context string, 0-255 bytes (not with external_mu); "
        "composite ML-DSA keys: the composite's ctx, 0-255 bytes."
    ),
]


def _exactly_one(*fields: str) -> dict[str, Any]:
    """JSON Schema for "exactly one of each pair of fields holds a value" (null counts as
    absent): ``_exactly_one("message", "digest")``. A single ``not``, so the object keeps its
    one set of properties for code generators."""
    refused: list[dict[str, Any]] = []
    for first, second in zip(fields[::2], fields[1::2], strict=True):
        refused.append(
            {
                "required": [first, second],
                "properties": {first: {"type": "string"}, second: {"type": "string"}},
            }
        )
        refused.append({"properties": {first: {"type": "null"}, second: {"type": "null"}}})
    return {"not": {"anyOf": refused}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class EncryptRequest(_Body):
    plaintext: Base64
    aad: Base64 | None = None
    key_version: VersionNumber | None = None
    context: Context | None = None


class DecryptRequest(_Body):
    ciphertext: str = Field(
        description="A token, or with 'format' the base64 of ciphertext made outside cryptd."
    )
    aad: Base64 | None = None
    format: ExternalFormat | None = None
    key_version: VersionNumber | None = None
    context: Context | None = None


class SignRequest(_Body):
    model_config = ConfigDict(json_schema_extra=_exactly_one("message", "digest"))
    message: Base64 | None = None
    digest: Base64 | None = None
    algorithm: SignAlgorithm | None = None
    signer_id: str | None = Field(default=None, description="SM2 signer ID, 0-255 bytes of UTF-8.")
    encoding: SignatureEncoding | None = None
    hash_algorithm: HashAlgorithm | None = None
    key_version: VersionNumber | None = None
    context: SigningContext | None = None
    message_type: MessageType | None = None


class VerifyRequest(SignRequest):
    """A signature (signing keys) or a MAC (HMAC keys, with ``message`` and ``context`` if
    derived): exactly one of ``signature`` and ``mac``."""

    model_config = ConfigDict(
        json_schema_extra=_exactly_one("message", "digest", "signature", "mac")
    )
    signature: Base64 | None = None
    mac: str | None = Field(default=None, description="An HMAC tag token (from /v1/hmac).")
    context: Base64 | None = Field(
        default=None,
        description="ML-DSA and composite ML-DSA: the signing context string (0-255 bytes); "
        "derived HMAC keys: the derivation context.",
    )


class RewrapRequest(_Body):
    ciphertext: Token
    aad: Base64 | None = None
    to_key: KeyName | None = None
    context: Context | None = None


class DatakeyRequest(_Body):
    bits: Annotated[Integer, Field(json_schema_extra={"enum": [128, 256]})] = 256
    aad: Base64 | None = None
    plaintext: bool = Field(default=True, description="false: the wrapped key only.")
    context: Context | None = None


class HmacRequest(_Body):
    message: Base64
    key_version: VersionNumber | None = None
    context: Context | None = None


class EncapsulateRequest(_Body):
    """No fields: a fresh secret under the key's active version."""


class DecapsulateRequest(_Body):
    ciphertext: Base64 = Field(
        description="The KEM ciphertext (FIPS 203 bytes; X-Wing: ct_ML-KEM || ct_X25519)."
    )
    key_version: VersionNumber | None = None


class RandomRequest(_Body):
    bytes: Annotated[Integer, Field(json_schema_extra={"minimum": 1, "maximum": 65536})]


class CreateKeyRequest(_Body):
    # convergent needs derived (400 otherwise)
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "required": ["convergent"],
                "properties": {"convergent": {"const": True}, "derived": {"const": False}},
            }
        }
    )
    type: KeyTypeName
    deletion_allowed: bool = False
    derived: bool = False
    convergent: bool = False
    auto_rotate_period: int = Field(
        default=0,
        ge=0,
        le=MAX_AUTO_ROTATE_PERIOD,
        description="Seconds between automatic rotations; 0: none (at least 3600 outside "
        "development).",
    )


class ImportKeyRequest(_Body):
    """A new key from material wrapped for import (docs/FORMAT.md, section 9)."""

    type: KeyTypeName
    ciphertext: Base64  # RSA-OAEP(ephemeral AES-256 key) || AES-KWP(material)
    # The OAEP hash: only SHA-256 (Vault's field, and its default).
    hash_function: Annotated[str, Field(json_schema_extra={"enum": ["SHA256"]})] | None = None
    deletion_allowed: bool = False
    derived: bool = False
    convergent: bool = False
    auto_rotate_period: int = Field(
        default=0,
        ge=0,
        le=MAX_AUTO_ROTATE_PERIOD,
        description="Seconds between automatic rotations; 0: none (as for create).",
    )


class ImportVersionRequest(_Body):
    ciphertext: Base64
    hash_function: Annotated[str, Field(json_schema_extra={"enum": ["SHA256"]})] | None = None


class RestoreKeyRequest(_Body):
    backup: Base64  # the blob GET /v1/keys/{key}/backup gave


def _some_change(schema: dict[str, Any]) -> None:
    # A PATCH must change something: at least one known field with a value (400 otherwise).
    schema["not"] = {"properties": {name: {"type": "null"} for name in schema["properties"]}}


class UpdateKeyRequest(_Body):
    model_config = ConfigDict(json_schema_extra=_some_change)
    min_decryption_version: VersionNumber | None = None
    deletion_allowed: bool | None = None
    auto_rotate_period: int | None = Field(default=None, ge=0, le=MAX_AUTO_ROTATE_PERIOD)
    state: SettableState | None = None
    min_encryption_version: MinEncryptionVersion | None = None


def parse_update(body: bytes) -> UpdateKeyRequest:
    """A PATCH body: no known field is 400 (the contract), an unknown one beside them 422."""
    document = parse_json_object(body)
    if not document.keys() & UpdateKeyRequest.model_fields.keys():
        known = ", ".join(UpdateKeyRequest.model_fields)
        raise InvalidRequest(f"nothing to change: send one of {known}")
    return validate(UpdateKeyRequest, document)


def decode_b64(value: str, field: str) -> bytes:
    try:
        return b64.decode(value)
    except ValueError:
        raise InvalidRequest(f"'{field}' is not valid base64 (RFC 4648, padded)") from None


def validate(model: type[M], data: Any) -> M:
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


def random_size(body: RandomRequest) -> int:
    if not 1 <= body.bytes <= MAX_RANDOM_BYTES:
        raise InvalidRequest(f"bytes must be between 1 and {MAX_RANDOM_BYTES}")
    return body.bytes


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
    return validate(model, parse_json_object(body))


class UnsealRequest(_Body):
    share: str = Field(
        max_length=1024, description="One operator's unseal share (a 33-word SLIP-39 mnemonic)."
    )
