"""How one definition becomes a method of both clients: the :class:`operation` descriptor
makes a function that returns the work of a call (one endpoint :class:`_Call`, or a plan of
several) a blocking method on :class:`CryptdClient` and a coroutine method on
:class:`AsyncCryptdClient`."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from cryptd_client._base import BaseClient, Plan
from cryptd_client._wire import _Call

if TYPE_CHECKING:
    from cryptd_client.client import AsyncCryptdClient, CryptdClient

P = ParamSpec("P")
T = TypeVar("T")

_WORK_ANNOTATION = re.compile(r"(?:_Call|Plan)\[(.*)\]")


def _describe(method: Callable[..., Any], build: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as ``build`` to help() and IDEs: its name, docstring and parameters, and the
    result type in place of the work's."""
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(method, name, getattr(build, name))
    signature = inspect.signature(build)
    work = _WORK_ANNOTATION.fullmatch(str(signature.return_annotation))
    if work is not None:
        signature = signature.replace(return_annotation=work.group(1))
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


class operation(Generic[P, T]):  # lower case: used as a decorator, like property
    """One public method of both clients, from ``build(client, *args)`` -> the work. Read
    from a :class:`CryptdClient` it is a method returning the result; from an
    :class:`AsyncCryptdClient`, a coroutine method (its arguments checked when awaited)."""

    def __init__(self, build: Callable[Concatenate[Any, P], _Call[T] | Plan[T]]) -> None:
        self.build = build  # the work of a call without sending it (what tests look at)

        def blocking(client: Any, /, *args: Any, **kwargs: Any) -> Any:
            return client._complete(client._steps(build(client, *args, **kwargs)))

        async def awaited(client: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await client._complete(client._steps(build(client, *args, **kwargs)))

        self._blocking = _describe(blocking, build)
        self._awaited = _describe(awaited, build)
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Callable[..., Any]: ...
    @overload
    def __get__(self, client: CryptdClient, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: AsyncCryptdClient, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: BaseClient | None, owner: type[Any]) -> Any:
        method = self._awaited if getattr(owner, "_asynchronous", False) else self._blocking
        # From the class, the plain function (as for any method); from a client, bound.
        return method if client is None else types.MethodType(method, client)
