"""The seal interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from service.errors import CryptdError


class SealError(CryptdError):
    """The seal cannot give (or keep) the master key. The message says what to do; it never
    holds a key, a PIN or a share."""

    code = "sealed"
    default_message = "the service is sealed"


@dataclass(frozen=True)
class SealStatus:
    """What ``GET /v1/sys/seal-status`` and ``/readyz`` say about the seal."""

    kind: str
    sealed: bool
    threshold: int
    progress: int
    available: bool  # the seal's backing (a token) answers; False: degraded, still serving
    reason: str | None = None
    refused: int = 0  # shares refused since the start (shamir)


class Seal(Protocol):
    kind: str

    def unseal(self) -> bytes:
        """The 32-byte master key; SealError with a one-line reason when it cannot."""
        ...

    def status(self) -> SealStatus:
        """Cheap and safe to call often (readiness); never raises."""
        ...

    def close(self) -> None: ...
