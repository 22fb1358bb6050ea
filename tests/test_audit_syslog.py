"""The audit trail's second sink: RFC 5424 over TCP, and never a cost to the file."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import orjson

from service.audit.syslog import SyslogSink, frame
from service.audit.writer import AuditWriter
from service.logs.audit import Audit
from tests.test_audit_trail import record, sign

HEADER = re.compile(
    rb"<86>1 \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z (\S+) cryptd (\d+) audit - (\{.*\})"
)


def read_frames(data: bytes) -> list[bytes]:
    """RFC 6587 octet counting: "LEN SP MSG", repeated."""
    frames = []
    while data:
        length, _, rest = data.partition(b" ")
        frames.append(rest[: int(length)])
        data = rest[int(length) :]
    return frames


def test_a_frame_is_rfc5424_with_its_octet_count() -> None:
    framed = frame(b'{"seq":1}\n', hostname="h1", pid=42)
    (message,) = read_frames(framed)
    match = HEADER.fullmatch(message)
    assert match is not None
    assert match.groups() == (b"h1", b"42", b'{"seq":1}')


def test_durable_lines_reach_the_syslog_server(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            while chunk := connection.recv(65536):
                received.extend(chunk)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sink = SyslogSink("127.0.0.1", listener.getsockname()[1])
    audit = Audit(None)
    writer = AuditWriter(str(tmp_path / "audit.log"), format=audit.fields, signer=sign,
                         secondary=sink)  # fmt: skip
    for n in range(5):
        writer.submit(record(n))
    assert writer.flush()
    writer.close()
    sink.close()
    thread.join(5)
    listener.close()
    messages = [HEADER.fullmatch(m) for m in read_frames(bytes(received))]
    assert all(messages)
    lines = [orjson.loads(m.group(3)) for m in messages if m is not None]
    on_disk = [orjson.loads(x) for x in (tmp_path / "audit.log").read_bytes().splitlines()]
    assert lines == on_disk  # the same lines, chain fields and checkpoints included
    assert sink.dropped == 0


def test_a_stuck_syslog_server_costs_the_file_nothing(tmp_path: Path) -> None:
    """A server that accepts and never reads: the sink's queue fills and drops; every file
    commit still completes at disk speed."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sink = SyslogSink("127.0.0.1", listener.getsockname()[1], max_pending=100)
    audit = Audit(None)
    writer = AuditWriter(str(tmp_path / "audit.log"), format=audit.fields, signer=sign,
                         secondary=sink, checkpoint_every=100_000)  # fmt: skip
    try:
        started = time.monotonic()
        for n in range(2000):
            writer.submit(record(n, detail={"pad": "x" * 500}))
        assert writer.flush(10)
        elapsed = time.monotonic() - started
    finally:
        writer.close()
        sink.close(0.1)
        listener.close()
    written = [x for x in (tmp_path / "audit.log").read_bytes().splitlines() if b'"encrypt"' in x]
    assert len(written) == 2000
    assert sink.dropped > 0
    assert elapsed < 5
