"""cryptd's Python client: every request signed (RFC 9421 ``hmac-sha256``), typed results,
typed errors, retries on 429 / 503 that honour ``Retry-After`` (never for key management that
changes state). Needs httpx and nothing of the
server::

    from cryptd_client import CryptdClient

    with CryptdClient.from_file(".cryptd-dev/client.json") as cryptd:
        token = cryptd.encrypt("orders", b"card 4111").ciphertext
        assert cryptd.decrypt("orders", token).plaintext == b"card 4111"

Binary values are ``bytes`` (sent as base64; a ``str`` where bytes belong raises TypeError),
ciphertext tokens are ``str``. :func:`sign_request` alone signs a request for any HTTP library.
"""

from __future__ import annotations

from cryptd_client.client import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    AsyncCryptdClient,
    CryptdClient,
    tls_context,
)
from cryptd_client.errors import (
    ERRORS,
    ConflictError,
    CryptdAPIError,
    CryptdConfigurationError,
    CryptdConnectionError,
    DecryptionFailedError,
    ForbiddenError,
    HeadersTooLargeError,
    InternalError,
    InvalidRequestError,
    KeyDisabledError,
    KeyNotFoundError,
    KeystoreUnavailableError,
    MethodNotAllowedError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RateLimitedError,
    UnauthenticatedError,
    UnsupportedMediaTypeError,
    api_error,
)
from cryptd_client.results import (
    DataKey,
    DecryptResult,
    Encapsulation,
    EncryptResult,
    KeyMetadata,
    KeyUsage,
    KeyVersion,
    MacResult,
    SharedSecret,
    SignResult,
)
from cryptd_client.signing import content_digest, sign_request

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT",
    "ERRORS",
    "AsyncCryptdClient",
    "ConflictError",
    "CryptdAPIError",
    "CryptdClient",
    "CryptdConfigurationError",
    "CryptdConnectionError",
    "DataKey",
    "DecryptResult",
    "DecryptionFailedError",
    "Encapsulation",
    "EncryptResult",
    "ForbiddenError",
    "HeadersTooLargeError",
    "InternalError",
    "InvalidRequestError",
    "KeyDisabledError",
    "KeyMetadata",
    "KeyNotFoundError",
    "KeyUsage",
    "KeyVersion",
    "KeystoreUnavailableError",
    "MacResult",
    "MethodNotAllowedError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "SharedSecret",
    "SignResult",
    "UnauthenticatedError",
    "UnsupportedMediaTypeError",
    "api_error",
    "content_digest",
    "sign_request",
    "tls_context",
]
