"""The clients: :class:`CryptdClient` (blocking) and :class:`AsyncCryptdClient` (asyncio).
Both offer the same methods (:mod:`cryptd_client._crypto_endpoints`,
:mod:`cryptd_client._key_endpoints`), build, sign and retry their
requests the same way (:mod:`cryptd_client._base`); each only opens its httpx client, sends
and sleeps. Retries on 429 / 503 honour ``Retry-After``."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Self, TypeVar

import httpx

from cryptd_client._base import (
    CAUGHT,
    DEFAULT_BATCH_SIZE,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    Steps,
    tls_context,
)
from cryptd_client._crypto_endpoints import CryptoEndpoints
from cryptd_client._key_endpoints import KeyEndpoints

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT",
    "AsyncCryptdClient",
    "CryptdClient",
    "tls_context",
]

T = TypeVar("T")


class CryptdClient(CryptoEndpoints, KeyEndpoints):
    """Blocking client. One keep-alive connection pool per instance; close it when done."""

    _http: httpx.Client
    _asynchronous = False

    def _open(self) -> None:
        self._http = httpx.Client(timeout=self.timeout, verify=self._tls_verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _complete(self, steps: Steps[T]) -> T:
        for action in steps:
            if isinstance(action, httpx.Request):
                try:
                    steps.answer(self._http.send(action))
                except CAUGHT as exc:
                    steps.answer(exc)
            else:
                time.sleep(action)
        return steps.result


class AsyncCryptdClient(CryptoEndpoints, KeyEndpoints):
    """asyncio client. One keep-alive connection pool per instance; ``aclose()`` it when done."""

    _http: httpx.AsyncClient
    _asynchronous = True

    def _open(self) -> None:
        self._http = httpx.AsyncClient(timeout=self.timeout, verify=self._tls_verify)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _complete(self, steps: Steps[T]) -> T:
        for action in steps:
            if isinstance(action, httpx.Request):
                try:
                    steps.answer(await self._http.send(action))
                except CAUGHT as exc:
                    steps.answer(exc)
            else:
                await asyncio.sleep(action)
        return steps.result
