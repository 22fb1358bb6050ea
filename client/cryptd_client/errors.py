"""Errors: one class per error code of the API, all :class:`CryptdAPIError`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final


class CryptdAPIError(Exception):
    """The service answered with an error (or a batch item failed)."""

    def __init__(self, status: int, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id


class InvalidRequestError(CryptdAPIError): ...


class DecryptionFailedError(CryptdAPIError): ...


class UnauthenticatedError(CryptdAPIError): ...


class ForbiddenError(CryptdAPIError): ...


class KeyNotFoundError(CryptdAPIError): ...


class NotFoundError(CryptdAPIError): ...


class MethodNotAllowedError(CryptdAPIError): ...


class ConflictError(CryptdAPIError): ...


class KeyDisabledError(CryptdAPIError): ...


class PayloadTooLargeError(CryptdAPIError): ...


class UnsupportedMediaTypeError(CryptdAPIError): ...


class RateLimitedError(CryptdAPIError): ...


class HeadersTooLargeError(CryptdAPIError): ...


class OverloadedError(CryptdAPIError): ...


class KeystoreUnavailableError(CryptdAPIError): ...


class InternalError(CryptdAPIError): ...


class CryptdConnectionError(Exception):
    """The service could not be reached (after the retries)."""


class CryptdConfigurationError(ValueError):
    """The client's own settings are unusable (a URL without http:// or https://, a secret
    that is not base64, a credential file that is not one): raised when the client is made,
    before any request. A ValueError, so code that caught the lower error still catches it."""


ERRORS: Final[Mapping[str, tuple[type[CryptdAPIError], int]]] = {
    "invalid_request": (InvalidRequestError, 400),
    "decryption_failed": (DecryptionFailedError, 400),
    "unauthenticated": (UnauthenticatedError, 401),
    "forbidden": (ForbiddenError, 403),
    "key_not_found": (KeyNotFoundError, 404),
    "not_found": (NotFoundError, 404),
    "method_not_allowed": (MethodNotAllowedError, 405),
    "conflict": (ConflictError, 409),
    "key_disabled": (KeyDisabledError, 409),
    "payload_too_large": (PayloadTooLargeError, 413),
    "unsupported_media_type": (UnsupportedMediaTypeError, 415),
    "rate_limited": (RateLimitedError, 429),
    "headers_too_large": (HeadersTooLargeError, 431),
    "overloaded": (OverloadedError, 503),
    "keystore_unavailable": (KeystoreUnavailableError, 503),
    "internal": (InternalError, 500),
}


def api_error(
    status: int | None, code: str, message: str, request_id: str | None = None
) -> CryptdAPIError:
    """The typed error for ``code``; ``status`` defaults to the code's usual status."""
    cls, usual_status = ERRORS.get(code, (CryptdAPIError, 500))
    return cls(usual_status if status is None else status, code, message, request_id)
