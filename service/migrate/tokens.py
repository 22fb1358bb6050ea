"""What a token tells without a key: its key type id (docs/FORMAT.md, sections 1 and 3).

A token does not name its key, only the key's type; two keys of one type cannot be told apart
here, so that question goes to the service (see :mod:`service.migrate.service`). Only the
header is read (the first four base64url characters hold the format byte and the type id):
the service checks the rest, and a token damaged further in fails there with its reason.
"""

from __future__ import annotations

import base64
import binascii
import re

from service.keys.token import FORMAT, PREFIX

from .model import FAIL_DAMAGED, FAIL_NOT_A_TOKEN

_HEAD = re.compile(re.escape(PREFIX) + r"[1-9][0-9]{0,9}:([A-Za-z0-9_-]{4})")
_NOT_A_TOKEN = (FAIL_NOT_A_TOKEN, "not a cryptd token (cryptd:v<N>:<base64url>)")
_DAMAGED = (FAIL_DAMAGED, "the token is damaged (its header is not a cryptd token header)")


def _classify(head: str) -> int | tuple[str, str]:
    match = _HEAD.fullmatch(head)
    if match is None:
        return _DAMAGED if head.startswith(PREFIX) else _NOT_A_TOKEN
    try:
        header = base64.urlsafe_b64decode(match.group(1))
    except binascii.Error:
        return _DAMAGED
    if header[0] != FORMAT:
        return _DAMAGED
    return header[1]


# Heads repeat (one per key version and type, times the 4 values of the body's first two
# bits), so a page's classification is mostly dictionary look-ups; bounded against junk.
_CACHE: dict[str, int | tuple[str, str]] = {}
_CACHE_LIMIT = 4096


def type_id(text: str) -> int | tuple[str, str]:
    """The key type id of ``text``, or a (reason, message) pair when it is no usable token."""
    colon = text.find(":", len(PREFIX))
    head = text[: colon + 5] if colon > 0 else text[:32]
    known = _CACHE.get(head)
    if known is None:
        known = _classify(head)
        if len(_CACHE) < _CACHE_LIMIT:
            _CACHE[head] = known
    return known
