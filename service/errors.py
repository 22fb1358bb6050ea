"""Domain errors. No HTTP here: the API maps each code to a status at the edge.

Every error carries a stable ``code`` (the contract's error code) and a message that is safe to
show a client: it never holds key material, plaintext or which check of a decryption failed.
Errors are plain picklable exceptions so they cross the process-pool boundary unchanged.
"""

from __future__ import annotations


class CryptdError(Exception):
    """Base of every error a client may see."""

    code = "internal"
    default_message = "internal error"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message
        super().__init__(self.message)

    def __reduce__(self) -> tuple[type[CryptdError], tuple[str]]:
        return (type(self), (self.message,))


class InvalidRequest(CryptdError):
    code = "invalid_request"
    default_message = "invalid request"


class SchemaError(InvalidRequest):
    """Request body failed schema validation (the API answers 422)."""


class _OneMessage(CryptdError):
    """An error whose message is always ``default_message``: whatever a caller passes, the
    client cannot learn which check failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(self.default_message)


class DecryptionFailed(_OneMessage):
    """Any decryption failure. One message for every cause: no oracle."""

    code = "decryption_failed"
    default_message = "decryption failed"


class Unauthenticated(_OneMessage):
    code = "unauthenticated"
    default_message = "request signature missing, invalid, expired or replayed"


class Forbidden(CryptdError):
    code = "forbidden"
    default_message = "this client may not perform this operation on this key"


class KeyNotFound(CryptdError):
    code = "key_not_found"
    default_message = "key or key version not found"


class Conflict(CryptdError):
    code = "conflict"
    default_message = "conflict"


class KeyDisabled(CryptdError):
    """The key's state refuses the operation (decrypt_only, disabled, pending_deletion); the
    message names the state and the operation."""

    code = "key_disabled"
    default_message = "the key's state refuses this operation"


class PayloadTooLarge(CryptdError):
    code = "payload_too_large"
    default_message = "payload too large"


class UnsupportedMediaType(CryptdError):
    """A request body that is not sent as JSON (415)."""

    code = "unsupported_media_type"
    default_message = "the body must be sent as application/json"


class _RetryLater(CryptdError):
    """A refusal a retry can cure, after ``retry_after`` seconds (the Retry-After answer)."""

    def __init__(self, message: str | None = None, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[type[CryptdError], tuple[str, float]]:  # type: ignore[override]
        return (type(self), (self.message, self.retry_after))


class RateLimited(_RetryLater):
    code = "rate_limited"
    default_message = "rate limit exceeded"


class Overloaded(_RetryLater):
    code = "overloaded"
    default_message = "service overloaded, retry later"


class Sealed(CryptdError):
    """The server does not hold its master key yet (service/seal/)."""

    code = "sealed"
    default_message = (
        "the service is sealed: operators must submit their unseal shares "
        "(cryptd operator unseal); GET /v1/sys/seal-status shows the progress"
    )


class KeystoreUnavailable(CryptdError):
    """The key store failed verification or could not be read or written: key management is
    refused and nothing was changed; crypto keeps serving the keyring in memory."""

    code = "keystore_unavailable"
    default_message = "the key store is unavailable; nothing was changed"


class Internal(CryptdError):
    code = "internal"
    default_message = "internal error"
