"""Request signing: RFC 9421 HTTP Message Signatures (``hmac-sha256``) and RFC 9530
``Content-Digest``, the one shape cryptd accepts::

    Content-Type: application/json
    Content-Digest: sha-256=:<base64 sha256(body)>:
    Signature-Input: sig1=("@method" "@path" "@query" "content-digest" "content-type")
                     ;created=<unix>;nonce="<random>";keyid="<client id>";alg="hmac-sha256"
    Signature: sig1=:<base64 hmac-sha256(secret, signature base)>:

Standard library only. The server's verifier (service/auth/signature.py) builds its signature
base with these same functions.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence
from typing import Final

ALGORITHM: Final = "hmac-sha256"
LABEL: Final = "sig1"
COVERED_COMPONENTS: Final = ("@method", "@path", "@query", "content-digest", "content-type")
# Signature parameters every request carries, in the order the signer writes them.
REQUIRED_PARAMS: Final = ("created", "nonce", "keyid", "alg")
CONTENT_TYPE: Final = "application/json"


def _ser_string(value: str) -> str:
    """An RFC 8941 sf-string: printable ASCII only, backslash and double quote escaped."""
    if not (value.isascii() and value.isprintable()):
        raise ValueError("structured-field strings hold printable ASCII only")
    if "\\" in value or '"' in value:
        value = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{value}"'


COVERED_SERIALIZED: Final = "(" + " ".join(_ser_string(name) for name in COVERED_COMPONENTS) + ")"


def serialize_signature_params(
    components: Sequence[str], params: Sequence[tuple[str, int | str]]
) -> str:
    """Serialize the ``@signature-params`` inner list, e.g. ``("@method");created=1``.

    Only the value types a cryptd signature uses: sf-string components, integer and string
    parameters. Raises ValueError for a string that is not printable ASCII.
    """
    if tuple(components) == COVERED_COMPONENTS:
        items = COVERED_SERIALIZED
    else:
        items = "(" + " ".join(_ser_string(name) for name in components) + ")"
    return items + "".join(
        f";{name}={value}" if type(value) is int else f";{name}={_ser_string(str(value))}"
        for name, value in params
    )


def signature_base(components: Sequence[tuple[str, str]], signature_params: str) -> bytes:
    """The RFC 9421 section 2.5 signature base: one ``"name": value`` line per component and
    the ``"@signature-params"`` line, joined by ``\\n``. Raises ValueError for a value that
    holds a line break or is not ASCII."""
    lines = [f'"{name}": {value}' for name, value in components]
    lines.append(f'"@signature-params": {signature_params}')
    text = "\n".join(lines)
    if "\r" in text or text.count("\n") != len(components):
        raise ValueError("a signature base component holds a line break")
    try:
        return text.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("a signature base component is not ASCII") from None


def hmac_sha256(secret: bytes, base: bytes) -> bytes:
    return hmac.digest(secret, base, "sha256")


def content_digest(body: bytes) -> str:
    """``Content-Digest`` field value for ``body`` (sha-256)."""
    return f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode('ascii')}:"


def _require_bytes(value: object, name: str) -> None:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"{name} must be bytes, not {type(value).__name__}")


def sign_request(
    method: str,
    url_path: str,
    query: str,
    body: bytes,
    client_id: str,
    secret: bytes,
    created: int | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """Headers that authenticate one request: Content-Type, Content-Digest, Signature-Input,
    Signature.

    ``url_path`` is the path exactly as it goes on the wire (percent-encoded), ``query`` the
    query string without ``?`` (empty when none), ``body`` the exact body bytes, ``secret``
    the client secret's *decoded* bytes (``base64.b64decode(secret_b64)``). A fresh random
    nonce and the current time are used unless given (known-answer tests give them).
    """
    _require_bytes(body, "body")
    _require_bytes(secret, "secret")
    digest = content_digest(bytes(body))
    params = serialize_signature_params(
        COVERED_COMPONENTS,
        (
            ("created", int(time.time()) if created is None else created),
            ("nonce", secrets.token_urlsafe(18) if nonce is None else nonce),
            ("keyid", client_id),
            ("alg", ALGORITHM),
        ),
    )
    base = signature_base(
        (
            ("@method", method.upper()),
            ("@path", url_path or "/"),
            ("@query", "?" + query),
            ("content-digest", digest),
            ("content-type", CONTENT_TYPE),
        ),
        params,
    )
    mac = base64.b64encode(hmac_sha256(bytes(secret), base)).decode("ascii")
    return {
        "Content-Type": CONTENT_TYPE,
        "Content-Digest": digest,
        "Signature-Input": f"{LABEL}={params}",
        "Signature": f"{LABEL}=:{mac}:",
    }
