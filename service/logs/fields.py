"""The values of a log line: the time as RFC 3339, and only plain scalars.

Shared by every kind of line (records, access, audit); ``bytes`` and objects are never
written (see :mod:`service.logs`).
"""

from __future__ import annotations

import time
from typing import Any

_PLAIN_TYPES = (str, int, float, bool, type(None))

# ".000Z" to ".999Z", and ".1000Z" ((now - second) * 1000 can round up to 1000 in the epoch's
# first second): an index costs half of formatting the milliseconds for every line.
_MILLISECONDS = tuple(f".{ms:03d}Z" for ms in range(1001))


def timestamp(now: float, _cache: list[Any] = [-1, ""]) -> str:  # noqa: B006 - per-second cache
    """RFC 3339 UTC with milliseconds; the date-time part is formatted once per second."""
    second = int(now)
    if second != _cache[0]:
        _cache[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _cache[0] = second
    day_and_time: str = _cache[1]
    return day_and_time + _MILLISECONDS[int((now - second) * 1000)]


def plain(value: object) -> object:
    """``value`` if it is a JSON scalar or a flat list of them; otherwise nothing is logged."""
    if isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, _PLAIN_TYPES) for v in value):
        return list(value)
    return None
