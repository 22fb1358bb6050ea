"""The record format and the hash chain.

A file is a sequence of JSON lines. Every line starts with ``seq`` (1, 2, ... per stream,
continuing across rotated files and restarts) and ``prev``, the SHA-256 of the previous line's
bytes (without its newline; 64 zeros before the first line of a stream). Editing, deleting,
inserting or swapping a line therefore breaks the ``prev`` of the line after it; a signed
checkpoint (:mod:`service.audit.checkpoint`) vouches for everything before it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import orjson

GENESIS = "0" * 64
OPEN = "audit.open"  # the first line a process writes to a file: who writes, where it continues
CHECKPOINT = "audit.checkpoint"


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


@dataclass(frozen=True, slots=True)
class Head:
    """Where a stream stands: the last line's number and hash."""

    seq: int = 0
    hash: str = GENESIS


def encode(head: Head, fields: dict[str, Any] | bytes) -> tuple[bytes, Head]:
    """The next line (with its newline) after ``head``, and the new head. ``fields``: a dict,
    or one already serialized (a JSON object, so a bad value fails its own record only)."""
    body = fields if isinstance(fields, bytes) else orjson.dumps(fields)
    prefix = b'{"seq":%d,"prev":"%s"' % (head.seq + 1, head.hash.encode())
    line = prefix + (b"}" if body == b"{}" else b"," + body[1:])
    return line + b"\n", Head(head.seq + 1, line_hash(line))


def encode_all(head: Head, bodies: list[bytes]) -> tuple[list[bytes], Head]:
    """:func:`encode` of each serialized record in turn: the lines, and the head after the
    last. (One head built per batch, not per line.)"""
    seq = head.seq
    prev = head.hash.encode()
    lines: list[bytes] = []
    for body in bodies:
        seq += 1
        line = b'{"seq":%d,"prev":"%s"' % (seq, prev) + (b"}" if body == b"{}" else b"," + body[1:])
        prev = hashlib.sha256(line).hexdigest().encode()
        lines.append(line + b"\n")
    return lines, head if seq == head.seq else Head(seq, prev.decode())


class BrokenTail(Exception):
    """The last line of a file is not a complete record (a torn write, a truncation)."""


def last_line(fd: int) -> bytes | None:
    """The last complete line of an open file, or None when it is empty. Raises
    :class:`BrokenTail` when the file does not end with a newline."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    block = 64 * 1024
    end = size
    tail = b""
    while end > 0:
        start = max(0, end - block)
        tail = os.pread(fd, end - start, start) + tail
        end = start
        if tail.count(b"\n") >= 2 or end == 0:
            break
    if not tail.endswith(b"\n"):
        raise BrokenTail("the file does not end with a complete line")
    return tail[:-1].rsplit(b"\n", 1)[-1]


def head_of(line: bytes) -> Head:
    """The head after ``line``; raises :class:`BrokenTail` when it is not a record."""
    try:
        record = orjson.loads(line)
        seq = record["seq"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise BrokenTail("the last line is not an audit record") from exc
    if not isinstance(seq, int) or seq < 1:
        raise BrokenTail("the last line has no sequence number")
    return Head(seq, line_hash(line))
