"""The audit stream: who did what with which key and version, when, and how it ended.

Two destinations. A file (``CRYPTD_AUDIT_LOG=/path``) is the audit trail proper
(:mod:`service.audit`): one hash-chained record per API request, durable before the request
is answered, signed checkpoints under the keyring's ``cryptd:audit-signing`` key, sensitive
values HMAC'd under ``cryptd:audit-hmac``. ``stderr`` shares the log stream: the same records,
neither chained nor waited for (development, or a platform that ships stderr).

Over 400 lines as one module: both destinations' lines, the request path's serialized
record (:meth:`Audit.plain_body`) and the group write's (:meth:`Audit.body`) share one
cache of serialized middles and one rule for sensitive values, which must not diverge.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, NamedTuple

import orjson

from service.audit import checkpoint, redact
from service.audit.writer import GROUP_DELAY, AuditWriter
from service.crypto.base import NO_OPTIONS
from service.keys.manager import KeyManager
from service.logs.fields import timestamp
from service.logs.writer import LineWriter

_SCALAR_VERSION = (int, type(None))  # a tuple: `int | None` would build a union per call
_EPOCH_TS = b'{"ts":"' + timestamp(0.0).encode() + b'"'  # a line's start, up to its time

# Request values an auditor may need to match but the log must not hold (their HMAC is kept).
SENSITIVE = ("aad", "context", "signer_id")


class RequestRecord(NamedTuple):
    """One API request's record, captured on the event loop; turned into a line (HMACs and
    all) when its group is written. ``values``: the request's parsed items, read only for
    :data:`SENSITIVE` fields. (A named tuple: immutable, and built on every request for a
    fraction of a frozen dataclass's cost, which sets each of its fields by a call.)"""

    when: float
    event: str
    outcome: str
    status: int
    client: str | None
    key: str | None
    key_version: int | tuple[int, ...] | None
    items: int
    request_id: str | None
    target_key: str | None = None
    detail: Mapping[str, Any] | None = None
    values: tuple[Any, ...] = ()
    method: str | None = None
    path: str | None = None


class Audit:
    """Who did what with which key and version, when, and how it ended.

    :meth:`commit` is the request path: one record per API request, awaited before the answer
    leaves. :meth:`record` is for work no request waits on (the scheduler's destructions).
    """

    def __init__(
        self,
        writer: LineWriter | None,
        *,
        trail: AuditWriter | None = None,
        fail_closed: bool = False,
        mac: redact.Mac | None = None,
        hash_key_names: bool = False,
    ) -> None:
        self._writer = writer
        self.trail = trail
        self.enabled = writer is not None or trail is not None
        self.fail_closed = fail_closed and trail is not None
        self._mac = mac
        self._hash_key_names = hash_key_names and mac is not None
        self._middles: dict[tuple[Any, ...], bytes] = {}  # see body()

    @classmethod
    def to_file(
        cls,
        path: str,
        manager: KeyManager,
        *,
        index: int = 0,
        fail_closed: bool = True,
        hash_key_names: bool = False,
        checkpoint_every: int = 1000,
        checkpoint_interval: float = 10.0,
        max_bytes: int = 0,
        on_failure: Any = None,
        secondary: Any = None,
        signing_key_type: str = checkpoint.SIGNING_KEY_TYPE,
        group_delay: float = GROUP_DELAY,
    ) -> Audit:
        """The audit trail in ``path`` (this worker's stream), its keys made on first use."""
        manager.ensure_internal_key(checkpoint.SIGNING_KEY, signing_key_type)
        audit = cls(
            None,
            fail_closed=fail_closed,
            mac=keyring_mac(manager),
            hash_key_names=hash_key_names,
        )
        audit.trail = AuditWriter(
            path,
            index=index,
            format=audit.body,
            signer=keyring_signer(manager, signing_key_type),
            checkpoint_every=checkpoint_every,
            checkpoint_interval=checkpoint_interval,
            max_bytes=max_bytes,
            on_failure=on_failure or (lambda lost: None),
            secondary=secondary,
            group_delay=group_delay,
        )
        audit.enabled = True
        audit.fail_closed = fail_closed
        return audit

    def begin(self) -> None:
        """A request whose record will follow has started (the trail groups its sync with the
        records of the requests still running)."""
        if self.trail is not None:
            self.trail.begin()

    def end(self) -> None:
        """A request counted by :meth:`begin` ended without a record."""
        if self.trail is not None:
            self.trail.end()

    def commit(self, record: RequestRecord, *, begun: bool = False) -> Awaitable[bool]:
        """To await: True once ``record`` is durable (at once for stderr); False when it could
        not be written (the caller refuses the request when :attr:`fail_closed`). ``begun``:
        the request was counted by :meth:`begin`. (The trail's future itself, not a coroutine
        around it: one object and one step fewer per request.)"""
        trail = self.trail
        if trail is not None:
            return trail.commit(record, begun=begun)
        return self._commit_stderr(record)

    async def _commit_stderr(self, record: RequestRecord) -> bool:
        if self._writer is not None:
            self._writer.write((self._stderr_line, (record,)), wait=True)
        return True

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
        """A record no request waits on. ``event``: key.destroy, or a request's event;
        ``outcome``: ok, error, partial (some batch items failed), scheduled (a deletion
        with a waiting period), or the error code of a refusal (``forbidden``,
        ``unauthenticated``, ...). ``detail``: fields of the event (a state change's
        ``state`` and ``previous_state``, a ``deletion_date``)."""
        if not isinstance(key_version, _SCALAR_VERSION):
            key_version = tuple(sorted(set(key_version)))
        trail = self.trail
        if trail is not None:
            when = time.time()
            captured = (when, event, outcome, 0, client, key, key_version, items, request_id)
            trail.submit(RequestRecord(*captured, target_key, detail))
            return
        writer = self._writer
        if writer is None:
            return
        fields = (time.time(), event, outcome, client, key, key_version, items, request_id)
        writer.write((_format_audit, (*fields, target_key, detail)), wait=True)

    def fields(self, record: RequestRecord) -> dict[str, Any]:
        """The record's line fields (after ``seq`` and ``prev``): identifiers and outcomes in
        clear, sensitive values as HMACs, never a value of the request's payload."""
        line = self._plain_fields(record)
        mac = self._mac
        if record.values and mac is not None:
            line.update(_sensitive(mac, record.values))
        return line

    def _plain_fields(self, record: RequestRecord) -> dict[str, Any]:
        """:meth:`fields` but the sensitive values' HMACs."""
        key, target, path = record.key, record.target_key, record.path
        mac = self._mac
        if self._hash_key_names and mac is not None:
            key = None if key is None else redact.hashed(mac, key)
            target = None if target is None else redact.hashed(mac, target)
            path = None if path is None else redact.hashed(mac, path)
        version = record.key_version
        line: dict[str, Any] = {
            "ts": timestamp(record.when),
            "event": record.event,
            "outcome": record.outcome,
            "status": record.status or None,
            "client": record.client,
            "key": key,
            "key_version": list(version) if isinstance(version, tuple) else version,
            "items": record.items,
            "request_id": record.request_id,
        }
        if target is not None:
            line["target_key"] = target
        if record.method is not None:
            line["method"] = record.method
            line["path"] = path
        if record.detail:
            line.update({k: v for k, v in record.detail.items() if k not in line})
        return line

    def body(self, record: RequestRecord) -> bytes:
        """:meth:`fields` serialized (the writer's format), the same bytes. A plain
        request's record (no target key, route, detail or sensitive value) repeats all but its
        time and request id from the records before it: that middle is serialized (and its key
        name HMAC'd) once per distinct value, which halves the writer's formatting CPU."""
        # One unpacking, not a named tuple's attribute lookup per field.
        when, _, _, _, _, _, _, _, request_id, target, detail, values, method, _ = record
        if target is None and method is None and not detail:
            # event, outcome, status, client, key, key_version, items
            line = self.plain_body(when, record[1:8], request_id, values, learn=True)
            if line is not None:
                return line
        fields = self._plain_fields(record)
        mac = self._mac
        if values and mac is not None:
            fields.update(_sensitive(mac, values))
        return orjson.dumps(fields)

    def plain_body(
        self,
        when: float,
        repeated: tuple[Any, ...],
        request_id: str | None,
        values: tuple[Any, ...],
        *,
        learn: bool = False,
    ) -> bytes | None:
        """:meth:`body` of a plain request's record (no target key, route or detail) from its
        parts, with no record built: ``repeated`` is its event, outcome, status, client, key,
        key version and items. None when it is not that simple after all (a sensitive value
        to HMAC, an unhashable field) or, unless ``learn``, when its middle is not known yet:
        then :meth:`body` of the whole record says it."""
        mac = self._mac
        if values and mac is not None and _found(values) is not None:
            return None
        try:
            middle = self._middles.get(repeated)
        except TypeError:  # an unhashable value (a list where a tuple was expected)
            return None
        if middle is None:
            if not learn:
                return None
            middle = self._middle(repeated)
        return b"".join(
            (b'{"ts":"', timestamp(when).encode(), middle, orjson.dumps(request_id), b"}")
        )

    def _middle(self, repeated: tuple[Any, ...]) -> bytes:
        whole = orjson.dumps(
            self._plain_fields(
                RequestRecord._make((0.0, *repeated, None, None, None, (), None, None))
            )
        )
        # {"ts":"1970-...Z","event":...,"request_id":null} -> ","event":...,"request_id":
        middle = b'"' + whole[len(_EPOCH_TS) : -len(b"null}")]
        if len(self._middles) >= _AUDIT_MIDDLES_MAX:
            self._middles.clear()
        self._middles[repeated] = middle
        return middle

    def _stderr_line(self, fields: tuple[Any, ...]) -> bytes:
        line = {"level": "info", "logger": "cryptd.audit", "msg": "audit"}
        line.update(self.fields(fields[0]))
        return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)

    def healthy(self) -> bool:
        """False while records cannot be written (for the readiness probe)."""
        if self.trail is not None:
            return self.trail.healthy()
        return self._writer is None or self._writer.failed_writes == 0

    def reason(self) -> str | None:
        """Why records cannot be written, for /readyz; None while they can."""
        if self.trail is not None:
            return self.trail.error
        return None if self.healthy() else "audit destination not writable"

    def rotate(self) -> None:
        if self.trail is not None:
            self.trail.rotate()

    def flush(self, timeout: float = 5.0) -> None:
        if self.trail is not None:
            self.trail.flush(timeout)
        elif self._writer is not None:
            self._writer.flush(timeout)

    def close(self) -> None:
        if self.trail is not None:
            self.trail.close()


def _sensitive(mac: redact.Mac, values: tuple[Any, ...]) -> dict[str, list[str]]:
    found = _found(values)
    if found is None:  # the common case: nothing to HMAC
        return {}
    return {name: redact.hashed_all(mac, found[name]) for name in SENSITIVE if name in found}


def _found(values: tuple[Any, ...]) -> dict[str, list[bytes]] | None:
    """The request's :data:`SENSITIVE` values by name, before any HMAC; None when there are
    none (the usual request)."""
    found: dict[str, list[bytes]] | None = None  # made only when a value is found
    for item in values:
        aad = getattr(item, "aad", b"")
        context = getattr(item, "context", None)
        signer_id = getattr(getattr(item, "options", NO_OPTIONS), "signer_id", None)
        if not aad and context is None and signer_id is None:
            continue  # the common case: nothing to HMAC
        if found is None:
            found = {}
        if aad:
            found.setdefault("aad", []).append(aad)
        if context is not None:
            found.setdefault("context", []).append(context)
        if signer_id is not None:
            found.setdefault("signer_id", []).append(signer_id)
    return found


def keyring_signer(
    manager: KeyManager, type_name: str = checkpoint.SIGNING_KEY_TYPE
) -> checkpoint.Signer:
    """Checkpoints signed by the latest version of ``cryptd:audit-signing`` (made on first use
    as ``type_name``, Ed25519 or SM2; a key made earlier keeps its type; internal keys are
    never exported, listed or used by a client)."""

    def sign(payload: bytes) -> tuple[int, bytes]:
        key = manager.ensure_internal_key(checkpoint.SIGNING_KEY, type_name)
        version = key.version()
        return version.version, version.handle.sign(payload, prehashed=False, options=NO_OPTIONS)

    return sign


def keyring_mac(manager: KeyManager) -> redact.Mac:
    """HMAC-SHA256 under ``cryptd:audit-hmac``: one salt for every replica of a deployment."""
    key = manager.ensure_internal_key(redact.HMAC_KEY, redact.HMAC_KEY_TYPE)
    handle = key.version(1).handle
    return handle.mac


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
