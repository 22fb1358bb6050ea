"""Each endpoint described once, as a :class:`_Call` (method, path, JSON body, response
parser), for both the blocking and the async client; and the check that every argument has
the wire's type."""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar
from urllib.parse import quote

from cryptd_client.errors import CryptdAPIError, api_error
from cryptd_client.results import (
    DataKey,
    DecryptResult,
    EncryptResult,
    KeyMetadata,
    MacResult,
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


Binary = bytes | bytearray | memoryview
_BINARY: Final = frozenset({"plaintext", "aad", "message", "digest", "signature", "context"})
_TEXT: Final = frozenset(
    {
        "format",
        "algorithm",
        "signer_id",
        "encoding",
        "hash_algorithm",
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


def _exactly_one(message: bytes | None, digest: bytes | None) -> None:
    if (message is None) == (digest is None):
        raise ValueError("give exactly one of message and digest")


def _encrypt(
    key: str,
    plaintext: bytes,
    aad: bytes | None,
    key_version: int | None,
    context: bytes | None = None,
) -> _Call[EncryptResult]:
    body = _body(plaintext=plaintext, aad=aad, key_version=key_version, context=context)
    return _Call("POST", _key_path("encrypt", key), body, _encrypt_result)


def _decrypt(
    key: str,
    ciphertext: str | bytes,
    aad: bytes | None,
    format: str | None,
    key_version: int | None,
    context: bytes | None = None,
) -> _Call[DecryptResult]:
    body = _body(
        ciphertext=ciphertext, aad=aad, format=format, key_version=key_version, context=context
    )
    return _Call("POST", _key_path("decrypt", key), body, _decrypt_result)


def _sign(key: str, fields: Mapping[str, Any]) -> _Call[SignResult]:
    _exactly_one(fields.get("message"), fields.get("digest"))
    return _Call("POST", _key_path("sign", key), _body(**fields), _sign_result)


def _verify(key: str, fields: Mapping[str, Any]) -> _Call[bool]:
    _exactly_one(fields.get("message"), fields.get("digest"))
    return _Call("POST", _key_path("verify", key), _body(**fields), _verify_result)


def _rewrap(
    key: str,
    ciphertext: str,
    aad: bytes | None,
    to_key: str | None,
    context: bytes | None = None,
) -> _Call[EncryptResult]:
    body = _body(ciphertext=ciphertext, aad=aad, to_key=to_key, context=context)
    return _Call("POST", _key_path("rewrap", key), body, _encrypt_result)


def _datakey(
    key: str, bits: int, aad: bytes | None, context: bytes | None = None
) -> _Call[DataKey]:
    body = _body(bits=bits, aad=aad, context=context)
    return _Call("POST", _key_path("datakey", key), body, _datakey_result)


def _datakey_wrapped(
    key: str, bits: int, aad: bytes | None, context: bytes | None
) -> _Call[EncryptResult]:
    body = _body(bits=bits, aad=aad, context=context, plaintext=False)
    return _Call("POST", _key_path("datakey", key), body, _encrypt_result)


def _hmac(
    key: str, message: bytes, key_version: int | None, context: bytes | None
) -> _Call[MacResult]:
    body = _body(message=message, key_version=key_version, context=context)
    return _Call("POST", _key_path("hmac", key), body, _mac_result)


def _verify_mac(
    key: str, message: bytes, mac: str, key_version: int | None, context: bytes | None
) -> _Call[bool]:
    body = _body(message=message, mac=mac, key_version=key_version, context=context)
    return _Call("POST", _key_path("verify", key), body, _verify_result)


def _random(size: int) -> _Call[bytes]:
    body = _body(bytes=size)
    return _Call("POST", "/v1/random", body, lambda data: _unb64(data["random"]))


def _create_key(
    key: str, type: str, deletion_allowed: bool, derived: bool, convergent: bool
) -> _Call[KeyMetadata]:
    body: dict[str, Any] = {"type": type, "deletion_allowed": deletion_allowed}
    if derived:
        body["derived"] = True
    if convergent:
        body["convergent"] = True
    return _key_call("POST", key, body)


def _wrapping_key() -> _Call[str]:
    return _Call("GET", "/v1/keys/wrapping-key", None, lambda data: str(data["public_key"]))


def _wrapped(public_pem: str, material: Binary) -> str:
    """``material`` wrapped for import, here, so it never travels in the clear: RSA-OAEP
    (SHA-256) of a fresh AES-256 key under the server's wrapping key, then AES key wrap with
    padding (RFC 5649) of the material - OpenBao's and AWS KMS's BYOK wrapping. Needs the
    ``cryptography`` package (the ``import`` extra), which the rest of this client does not."""
    try:
        import os

        from cryptography.hazmat.primitives import hashes, keywrap, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
    except ImportError as exc:  # pragma: no cover - the server's tests always have it
        raise ImportError(
            "importing key material needs 'cryptography': pip install 'cryptd-client[import]'"
        ) from exc
    if not isinstance(material, Binary):
        raise TypeError(f"material must be bytes, not {type(material).__name__}")
    public = serialization.load_pem_public_key(public_pem.encode("ascii"))
    if not isinstance(public, rsa.RSAPublicKey):
        raise ValueError("the wrapping key is not an RSA public key")
    ephemeral = os.urandom(32)
    oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
    wrapped = public.encrypt(ephemeral, oaep) + keywrap.aes_key_wrap_with_padding(
        ephemeral, bytes(material)
    )
    return _b64(wrapped)


def _import_key(
    key: str, public_pem: str, type: str, material: Binary, flags: Mapping[str, bool]
) -> _Call[KeyMetadata]:
    body = _body(type=type, ciphertext=_wrapped(public_pem, material), **flags)
    return _Call("POST", _key_path("keys", key) + "/import", body, KeyMetadata.from_json)


def _import_version(key: str, public_pem: str, material: Binary) -> _Call[KeyMetadata]:
    body = _body(ciphertext=_wrapped(public_pem, material))
    return _Call("POST", _key_path("keys", key) + "/import-version", body, KeyMetadata.from_json)


def _backup_key(key: str) -> _Call[str]:
    return _Call("GET", _key_path("keys", key) + "/backup", None, lambda d: str(d["backup"]))


def _restore_key(key: str, backup: str) -> _Call[KeyMetadata]:
    if not isinstance(backup, str):
        raise TypeError(f"backup is the text backup_key gave (str), not {type(backup).__name__}")
    body = {"backup": backup}
    return _Call("POST", _key_path("keys", key) + "/restore", body, KeyMetadata.from_json)


def _list_keys() -> _Call[list[KeyMetadata]]:
    return _Call(
        "GET", "/v1/keys", None, lambda data: [KeyMetadata.from_json(k) for k in data["keys"]]
    )


def _key_call(method: str, key: str, body: Mapping[str, Any] | None) -> _Call[KeyMetadata]:
    return _Call(method, _key_path("keys", key), body, KeyMetadata.from_json)


_UPDATABLE: Final = (
    "min_decryption_version",
    "deletion_allowed",
    "auto_rotate_period",
    "state",
    "min_encryption_version",
)


def _update_key(key: str, changes: Mapping[str, Any]) -> _Call[KeyMetadata]:
    body = _body(**changes)
    if not body:
        raise ValueError("give at least one of " + ", ".join(_UPDATABLE))
    return _key_call("PATCH", key, body)


def _cancel_deletion(key: str) -> _Call[KeyMetadata]:
    return _Call("POST", _key_path("keys", key) + "/cancel-deletion", None, KeyMetadata.from_json)


def _rotate_key(key: str) -> _Call[KeyMetadata]:
    return _Call("POST", _key_path("keys", key) + "/rotate", None, KeyMetadata.from_json)


def _deleted(data: Mapping[str, Any] | None) -> KeyMetadata | None:
    # 204: deleted at once (no body); 202: scheduled, the pending key's metadata.
    return None if data is None else KeyMetadata.from_json(data)


def _delete_key(key: str) -> _Call[KeyMetadata | None]:
    return _Call("DELETE", _key_path("keys", key), None, _deleted)


def _healthz() -> _Call[dict[str, Any]]:
    return _Call("GET", "/healthz", None, lambda data: dict(data or {}), signed=False)


def _batch(
    operation: str,
    key: str,
    items: Sequence[Mapping[str, Any]],
    parse: Callable[[Mapping[str, Any]], T],
) -> _Call[list[T | CryptdAPIError]]:
    body = {"batch": [_item(item) for item in items]}
    return _Call("POST", _key_path(operation, key), body, _batch_parser(parse))


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _encrypt_items(items: Sequence[Binary | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [i if isinstance(i, Mapping) else {"plaintext": i} for i in items]


def _ciphertext_items(
    items: Sequence[str | Binary | Mapping[str, Any]],
) -> list[Mapping[str, Any]]:
    return [i if isinstance(i, Mapping) else {"ciphertext": i} for i in items]


def _sign_items(items: Sequence[Binary | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [i if isinstance(i, Mapping) else {"message": i} for i in items]


def _verify_items(
    items: Sequence[tuple[bytes, bytes] | Mapping[str, Any]],
) -> list[Mapping[str, Any]]:
    return [{"message": i[0], "signature": i[1]} if isinstance(i, tuple) else i for i in items]
