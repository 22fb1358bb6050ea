"""The audit stream: who did what with which key and version, when, and how it ended.

Its own destination when configured (a file opened append-only), never blocking on I/O, and
never dropping a record: when the destination is stuck, the caller waits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from service.logs.fields import timestamp
from service.logs.writer import LineWriter

_SCALAR_VERSION = (int, type(None))  # a tuple: `int | None` would build a union per call


class Audit:
    """Who did what with which key and version, when, and how it ended.

    One line per key-management action and per decrypt/sign/rewrap request (a batch is one
    line with its item count and the versions it used). Never blocks on I/O: lines go through
    the writer thread. Only when ``max_pending`` lines are already waiting (the destination is
    stuck) does a caller wait, rather than drop a record.
    """

    def __init__(self, writer: LineWriter | None) -> None:
        self._writer = writer
        self.enabled = writer is not None

    def record(
        self,
        event: str,
        *,
        client: str | None,
        key: str,
        outcome: str,
        key_version: int | Sequence[int] | None = None,
        request_id: str | None = None,
        items: int = 1,
        target_key: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        """``event``: decrypt, sign, rewrap, key.create, key.rotate, key.update, key.state,
        key.delete, key.cancel_deletion, key.destroy, …
        ``outcome``: ok, error, partial (some batch items failed), denied, scheduled (a
        deletion with a waiting period), or an error code. ``detail``: fields of the event
        (a state change's ``state`` and ``previous_state``, a ``deletion_date``)."""
        writer = self._writer
        if writer is None:
            return
        if not isinstance(key_version, _SCALAR_VERSION):
            key_version = tuple(sorted(set(key_version)))
        fields = (time.time(), event, outcome, client, key, key_version, items, request_id)
        writer.write((_format_audit, (*fields, target_key, detail)), wait=True)

    def healthy(self) -> bool:
        """False once a write to the audit destination failed (for the readiness probe)."""
        return self._writer is None or self._writer.failed_writes == 0

    def flush(self, timeout: float = 5.0) -> None:
        if self._writer is not None:
            self._writer.flush(timeout)


def _format_audit(fields: tuple[Any, ...]) -> bytes:
    when, event, outcome, client, key, key_version, items, request_id, target_key, detail = fields
    if target_key is None and not detail:
        # The request's lines: all but the time and the request id repeat from line to line.
        repeated = (event, outcome, client, key, key_version, items)
        middle = _audit_middles.get(repeated)
        if middle is None:
            middle = _audit_middle(repeated)
        return b"".join(
            (b'{"ts":"', timestamp(when).encode(), middle, orjson.dumps(request_id), b"}\n")
        )
    line = _audit_line(when, event, outcome, client, key, key_version, items, request_id)
    if target_key is not None:
        line["target_key"] = target_key
    if detail:
        line.update({name: value for name, value in detail.items() if name not in line})
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _audit_line(
    when: float | None,
    event: str,
    outcome: str,
    client: str | None,
    key: str,
    key_version: int | tuple[int, ...] | None,
    items: int,
    request_id: str | None,
) -> dict[str, Any]:
    return {
        "ts": None if when is None else timestamp(when),
        "level": "info",
        "logger": "cryptd.audit",
        "msg": "audit",
        "event": event,
        "outcome": outcome,
        "client": client,
        "key": key,
        "key_version": list(key_version) if isinstance(key_version, tuple) else key_version,
        "items": items,
        "request_id": request_id,
    }


# What the lines of one (event, outcome, client, key, version, items) write between the time and
# the request id, serialized once: bounded, since key names and version lists come from clients.
_audit_middles: dict[tuple[Any, ...], bytes] = {}
_AUDIT_MIDDLES_MAX = 4096


def _audit_middle(repeated: tuple[Any, ...]) -> bytes:
    event, outcome, client, key, key_version, items = repeated
    whole = orjson.dumps(_audit_line(None, event, outcome, client, key, key_version, items, None))
    # {"ts":null,...,"items":N,"request_id":null} -> ",...,"items":N,"request_id":"
    middle = b'"' + whole[len(b'{"ts":null') : -len(b"null}")]
    if len(_audit_middles) >= _AUDIT_MIDDLES_MAX:
        _audit_middles.clear()
    _audit_middles[repeated] = middle
    return middle
