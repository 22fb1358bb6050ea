"""Proving an audit trail: the chain of every stream across its files, every checkpoint.

Files are grouped by the stream their first line (``audit.open``) names and ordered by
sequence number, so rotated and per-worker files may be given in any order. A stream must
start at sequence 1 (unless ``partial``: earlier files were archived), every line must carry
the hash of the line before it and the next number, every checkpoint must verify under the
keyring's audit signing key, and every file but a stream's last must end with a checkpoint
(rotation writes one), so a rotated file cut short at a line boundary is caught too. The first
bad record is named by file, line and sequence number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from service.audit import chain, checkpoint


@dataclass
class StreamReport:
    stream: str
    files: list[str] = field(default_factory=list)
    records: int = 0
    checkpoints: int = 0
    first_seq: int = 0
    last_seq: int = 0
    unsigned_tail: int = 0  # lines after the last checkpoint


@dataclass
class Report:
    streams: list[StreamReport] = field(default_factory=list)
    error: str | None = None  # the first bad record, or why the files cannot be checked

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _File:
    path: str
    lines: list[bytes]
    records: list[dict[str, Any]]


class _Bad(Exception):
    pass


def verify(
    paths: Sequence[str | Path],
    keys: Mapping[int, checkpoint.VerifyingKey],
    *,
    partial: bool = False,
    sealed: bool = False,
) -> Report:
    """Check ``paths`` with the signing key versions ``keys``. ``sealed``: every stream must
    also end with a checkpoint (a clean shutdown or rotation writes one)."""
    report = Report()
    try:
        streams: dict[str, list[_File]] = {}
        for path in paths:
            found = _read(str(path))
            streams.setdefault(found.records[0]["stream"], []).append(found)
        for name in sorted(streams):
            files = sorted(streams[name], key=lambda f: int(f.records[0]["seq"]))
            stream = StreamReport(name, [f.path for f in files])
            report.streams.append(stream)
            _check_stream(stream, files, keys, partial=partial, sealed=sealed)
    except _Bad as exc:
        report.error = str(exc)
    return report


def _read(path: str) -> _File:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise _Bad(f"{path}: cannot be read ({exc.strerror})") from None
    if not data:
        raise _Bad(f"{path}: empty (an audit file starts with its audit.open line)")
    lines = data.split(b"\n")
    if lines[-1] != b"":
        raise _Bad(f"{path}:{len(lines)}: incomplete last line (the file was truncated)")
    lines.pop()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise _Bad(f"{path}:{number}: not a JSON record") from None
        if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
            raise _Bad(f"{path}:{number}: not an audit record (no sequence number)")
        if not isinstance(record.get("prev"), str):
            raise _Bad(f"{path}:{number}: not an audit record (no previous hash)")
        records.append(record)
    first = records[0]
    if first.get("event") != chain.OPEN or not isinstance(first.get("stream"), str):
        raise _Bad(f"{path}:1 (seq {first['seq']}): the file does not start with audit.open")
    return _File(path, lines, records)


def _check_stream(
    stream: StreamReport,
    files: list[_File],
    keys: Mapping[int, checkpoint.VerifyingKey],
    *,
    partial: bool,
    sealed: bool,
) -> None:
    head: chain.Head | None = None
    first = files[0].records[0]
    stream.first_seq = first["seq"]
    if not partial and (first["seq"] != 1 or first["prev"] != chain.GENESIS):
        raise _Bad(
            f"{files[0].path}:1 (seq {first['seq']}): stream {stream.stream} does not start at"
            " seq 1 (earlier files missing? --partial checks from here)"
        )
    for position, found in enumerate(files):
        for number, (line, record) in enumerate(zip(found.lines, found.records, strict=True), 1):
            where = f"{found.path}:{number} (seq {record['seq']})"
            if head is not None:
                if record["seq"] != head.seq + 1:
                    raise _Bad(f"{where}: expected seq {head.seq + 1} (a record missing or moved)")
                if record["prev"] != head.hash:
                    raise _Bad(f"{where}: the previous record was altered, removed or moved")
            if record.get("event") == chain.CHECKPOINT:
                if record.get("stream") != stream.stream:
                    raise _Bad(f"{where}: checkpoint of another stream")
                why = checkpoint.check(record, keys)
                if why is not None:
                    raise _Bad(f"{where}: {why}")
                stream.checkpoints += 1
                stream.unsigned_tail = 0
            else:
                stream.records += 1
                stream.unsigned_tail += 1
            head = chain.Head(record["seq"], chain.line_hash(line))
        last = found.records[-1]
        if position < len(files) - 1 and last.get("event") != chain.CHECKPOINT:
            raise _Bad(
                f"{found.path}:{len(found.lines)} (seq {last['seq']}): a rotated file must end"
                " with a checkpoint (records after it were cut)"
            )
    assert head is not None
    stream.last_seq = head.seq
    if sealed and stream.unsigned_tail:
        raise _Bad(
            f"{files[-1].path}: stream {stream.stream} ends with {stream.unsigned_tail}"
            " records after its last checkpoint"
        )
