"""The pipeline's audit hook (service/api/auditing.py): the record is durable before the
answer's first byte, names the error code of a refusal, and replaces an answer whose record
could not be written by 503 audit_unavailable."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from service.api import auditing
from service.api.auditing import AuditedSend, record_of
from service.asgi import error_body
from service.audit.redact import salted
from service.crypto.base import SignOptions
from service.logs.audit import Audit
from service.operations import EncryptItem, SignItem
from tests.test_audit_trail import open_audit


def scope(request_id: str = "req-p") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/encrypt/payments",
        "state": {"request_id": request_id, "crypto_operation": "encrypt"},
        "path_params": {"key": "payments"},
    }


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


async def test_the_record_is_on_disk_before_the_answer_starts(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    seen_on_disk: list[bool] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            seen_on_disk.append(any(r.get("request_id") == "req-p" for r in lines(path)))

    try:
        request = scope()
        request["state"].update(key="payments", operation="encrypt", key_version=2)
        hook = AuditedSend(audit, request, send, b"req-p")
        await hook({"type": "http.response.start", "status": 200, "headers": []})
        await hook({"type": "http.response.body", "body": b"{}"})
    finally:
        audit.close()
    assert seen_on_disk == [True]
    (record,) = [r for r in lines(path) if r.get("request_id") == "req-p"]
    assert (record["event"], record["outcome"], record["status"]) == ("encrypt", "ok", 200)
    assert (record["key"], record["key_version"]) == ("payments", 2)


async def test_a_refusal_is_recorded_with_its_error_code(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    try:
        hook = AuditedSend(audit, scope(), send, b"req-p")
        await hook({"type": "http.response.start", "status": 403, "headers": []})
        assert sent == []  # held until its body names the code
        await hook({"type": "http.response.body", "body": error_body("forbidden", "no")})
    finally:
        audit.close()
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    (record,) = [r for r in lines(path) if r.get("request_id") == "req-p"]
    assert (record["event"], record["outcome"], record["status"]) == ("encrypt", "forbidden", 403)
    assert record["key"] == "payments"
    assert record["client"] is None


async def test_an_unwritable_record_turns_a_200_into_503(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    try:
        path.chmod(0o400)
        hook = AuditedSend(audit, scope(), send, b"req-p")
        await hook({"type": "http.response.start", "status": 200, "headers": []})
        await hook({"type": "http.response.body", "body": b'{"ciphertext":"secret"}'})
    finally:
        path.chmod(0o600)
        audit.close()
    assert hook.replaced
    assert sent[0]["status"] == 503
    assert (b"x-request-id", b"req-p") in sent[0]["headers"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert orjson.loads(body)["error"]["code"] == "audit_unavailable"
    assert b"secret" not in body
    assert "req-p" not in path.read_text()


async def test_failing_open_answers_anyway(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    audit.fail_closed = False
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    try:
        path.chmod(0o400)
        hook = AuditedSend(audit, scope(), send, b"req-p")
        await hook({"type": "http.response.start", "status": 200, "headers": []})
    finally:
        path.chmod(0o600)
        audit.close()
    assert sent[0]["status"] == 200
    assert audit.trail is not None
    assert audit.trail.failures == 1


def test_stderr_audit_never_fails_closed() -> None:
    assert not Audit(None, fail_closed=True).fail_closed


class _Client:
    client_id = "c1"


_PLAIN: dict[str, Any] = {
    "request_id": "r1",
    "crypto_operation": "encrypt",
    "operation": "encrypt",
    "key": "payments",
    "key_version": 2,
    "client": _Client(),
}
_STATES: list[tuple[dict[str, Any], int, str | None]] = [
    (_PLAIN, 200, None),
    ({**_PLAIN, "audit_values": (EncryptItem(b"x"),)}, 200, None),
    ({**_PLAIN, "audit_values": (EncryptItem(b"x", aad=b"a"),)}, 200, None),
    ({**_PLAIN, "audit_values": (SignItem(b"m", False, SignOptions(signer_id=b"s")),)}, 200, None),
    ({**_PLAIN, "key_version": (3,), "audit_items": 2}, 200, None),
    ({**_PLAIN, "key_version": (1, 3), "audit_items": 2, "audit_outcome": "partial"}, 200, None),
    ({**_PLAIN, "key_version": [1, 3]}, 200, None),  # unhashable: the record says it
    (_PLAIN, 403, "forbidden"),
    (_PLAIN, 429, None),
    ({"request_id": "r2", "crypto_operation": "encrypt"}, 401, "unauthenticated"),
    ({**_PLAIN, "operation": "rewrap", "to_key": "other"}, 200, None),
    ({**_PLAIN, "audit_event": "key.create", "audit_detail": {"type": "aes256-gcm"}}, 200, None),
    ({**_PLAIN, "approval_id": "a1"}, 200, None),
    ({**_PLAIN, "request_id": 'odd "id"\n'}, 200, None),
]


@pytest.mark.parametrize("hash_key_names", [False, True])
def test_a_usual_record_serialized_at_once_is_the_record_the_writer_would_make(
    monkeypatch: pytest.MonkeyPatch, hash_key_names: bool
) -> None:
    # line_of (the request path) and body(record_of) (the group write) give the same bytes,
    # before and after the record's middle is known.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.123)
    audit = Audit(None, mac=salted(b"k" * 32), hash_key_names=hash_key_names)
    for state, status, code in _STATES:
        request = {**scope(), "state": state}
        expected = audit.body(record_of(request, status, code))
        for _ in range(2):
            line = auditing.line_of(audit, request, status, code)
            assert (line if isinstance(line, bytes) else audit.body(line)) == expected
    usual = auditing.line_of(audit, {**scope(), "state": _PLAIN}, 200, None)
    assert type(usual) is bytes  # the usual request's record is never built
