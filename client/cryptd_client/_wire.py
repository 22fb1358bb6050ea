"""What goes on the wire, for every endpoint: a :class:`_Call` (method, path, JSON body,
response parser), the check that every argument has the wire's type (bytes as base64), and
the parsers that turn responses into results."""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar
from urllib.parse import quote

from cryptd_client.errors import CryptdAPIError, api_error
from cryptd_client.results import (
    DataKey,
    DecryptResult,
    Encapsulation,
    EncryptResult,
    MacResult,
    SharedSecret,
    SignResult,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    method: str
    path: str
    payload: Mapping[str, Any] | None
    parse: Callable[[Any], T]
    signed: bool = True
    # False for key management that changes state (create, rotate, PATCH, delete, import,
    # restore...): the API has no idempotency key, so such a call is never sent twice.
    idempotent: bool = True


Binary = bytes | bytearray | memoryview
_BINARY: Final = frozenset({"plaintext", "aad", "message", "digest", "signature", "context"})
_TEXT: Final = frozenset(
    {
        "format",
        "algorithm",
        "signer_id",
        "encoding",
        "hash_algorithm",
        "message_type",
        "to_key",
        "type",
        "mac",
        "state",
    }
)
_INTEGER: Final = frozenset(
    {
        "key_version",
        "bits",
        "min_decryption_version",
        "min_encryption_version",
        "auto_rotate_period",
        "bytes",
    }
)
_BOOLEAN: Final = frozenset({"deletion_allowed", "derived", "convergent"})


def _b64(data: Binary) -> str:
    return base64.b64encode(data).decode("ascii")


def _wire_value(name: str, value: Any, fields: Mapping[str, Any]) -> Any:
    """One field as JSON, its Python type checked against the wire's: binary fields take
    bytes (sent as base64; a str is refused, never guessed to be base64), a ciphertext token
    is a str (bytes only for an external ``format``), numbers are int, flags bool."""
    if name in _BINARY:
        if name == "plaintext" and type(value) is bool:  # datakey's flag, not a payload
            return value
        if not isinstance(value, Binary):
            raise TypeError(f"{name} must be bytes, not {type(value).__name__}")
        return _b64(value)
    if name == "ciphertext":
        if isinstance(value, str):
            return value
        if isinstance(value, Binary) and fields.get("format") is not None:
            return _b64(value)
        raise TypeError(
            "ciphertext is a token (str); bytes are for ciphertext made outside cryptd, "
            f"with format=..., not {type(value).__name__}"
        )
    if name in _TEXT and not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    if name in _INTEGER and (type(value) is not int):
        raise TypeError(f"{name} must be int, not {type(value).__name__}")
    if name in _BOOLEAN and type(value) is not bool:
        raise TypeError(f"{name} must be bool, not {type(value).__name__}")
    if isinstance(value, Binary):  # a field this client does not know: binary is base64
        return _b64(value)
    return value


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _key_path(operation: str, key: str) -> str:
    # Percent-encode so the signed path is the path on the wire whatever the name holds.
    return f"/v1/{operation}/{quote(key, safe='')}"


def _body(**fields: Any) -> dict[str, Any]:
    """JSON body from keyword fields: None left out, types checked, bytes as base64."""
    return {
        name: _wire_value(name, value, fields)
        for name, value in fields.items()
        if value is not None
    }


def _item(value: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"a batch item is a mapping of fields, not {type(value).__name__}")
    return _body(**value)


def _encrypt_result(data: Mapping[str, Any]) -> EncryptResult:
    return EncryptResult(ciphertext=data["ciphertext"], key_version=int(data["key_version"]))


def _decrypt_result(data: Mapping[str, Any]) -> DecryptResult:
    return DecryptResult(plaintext=_unb64(data["plaintext"]), key_version=int(data["key_version"]))


def _sign_result(data: Mapping[str, Any]) -> SignResult:
    return SignResult(signature=_unb64(data["signature"]), key_version=int(data["key_version"]))


def _verify_result(data: Mapping[str, Any]) -> bool:
    valid = data["valid"]
    if not isinstance(valid, bool):
        raise ValueError("'valid' is not a boolean")
    return valid


def _mac_result(data: Mapping[str, Any]) -> MacResult:
    return MacResult(mac=data["mac"], key_version=int(data["key_version"]))


def _datakey_result(data: Mapping[str, Any]) -> DataKey:
    return DataKey(
        plaintext=_unb64(data["plaintext"]),
        ciphertext=data["ciphertext"],
        key_version=int(data["key_version"]),
    )


def _encapsulation(data: Mapping[str, Any]) -> Encapsulation:
    return Encapsulation(
        ciphertext=_unb64(data["ciphertext"]),
        shared_secret=_unb64(data["shared_secret"]),
        key_version=int(data["key_version"]),
    )


def _shared_secret(data: Mapping[str, Any]) -> SharedSecret:
    return SharedSecret(
        shared_secret=_unb64(data["shared_secret"]), key_version=int(data["key_version"])
    )


def _batch_parser(
    parse: Callable[[Mapping[str, Any]], T],
) -> Callable[[Any], list[T | CryptdAPIError]]:
    def parse_batch(data: Mapping[str, Any]) -> list[T | CryptdAPIError]:
        results: list[T | CryptdAPIError] = []
        for item in data["batch"]:
            error = item.get("error")
            if error is not None:
                results.append(api_error(None, error.get("code", ""), error.get("message", "")))
            else:
                results.append(parse(item))
        return results

    return parse_batch
