"""Frames between the parent and a worker process over a Unix stream socket.

A frame is a fixed header (payload length, message id, kind) and a payload, usually a pickle
(protocol 5: framed, binary-safe bytes without base64 or per-item overhead). One frame carries one
task however many items the caller batched into it. Both sides write header and payload with one
gather-write, so a payload is never copied to prepend its header.
"""

from __future__ import annotations

import enum
import io
import pickle
import socket
import struct

PICKLE_PROTOCOL = 5
HEADER = struct.Struct("!QQB")
MAX_PAYLOAD = 1 << 31
"""Refuse absurd lengths: a corrupt header must not make a side allocate gigabytes."""


class Kind(enum.IntEnum):
    # parent -> worker
    TASK = 1
    BROADCAST = 2
    # worker -> parent
    READY = 10
    INIT_FAILED = 11
    RESULT = 12
    ERROR = 13
    BROADCAST_DONE = 14
    BROADCAST_FAILED = 15


class ProtocolError(Exception):
    """The peer sent something that is not a frame."""


def dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def loads(data: bytes | bytearray | memoryview) -> object:
    # Both ends are this service: a worker and its parent over a private socketpair that no
    # other process holds. Nothing from a client is ever unpickled.
    return pickle.loads(data)  # noqa: S301


def header(kind: Kind, msg_id: int, length: int) -> bytes:
    if length > MAX_PAYLOAD:
        raise ValueError("frame payload too large")
    return HEADER.pack(length, msg_id, kind)


def parse_header(buf: bytes | bytearray | memoryview, offset: int = 0) -> tuple[Kind, int, int]:
    """Return (kind, message id, payload length)."""
    length, msg_id, raw_kind = HEADER.unpack_from(buf, offset)
    if length > MAX_PAYLOAD:
        raise ProtocolError("frame payload too large")
    try:
        kind = Kind(raw_kind)
    except ValueError:
        raise ProtocolError("unknown frame kind") from None
    return kind, msg_id, length


def read_frame(reader: io.BufferedIOBase) -> tuple[Kind, int, bytes] | None:
    """Blocking read of one frame; None at a clean end of stream (the peer closed)."""
    head = reader.read(HEADER.size)
    if not head:
        return None
    if len(head) != HEADER.size:
        raise ProtocolError("truncated frame header")
    kind, msg_id, length = parse_header(head)
    payload = reader.read(length) if length else b""
    if len(payload) != length:
        raise ProtocolError("truncated frame payload")
    return kind, msg_id, payload


def write_frame(sock: socket.socket, kind: Kind, msg_id: int, payload: bytes) -> None:
    """Blocking write of one frame with a single gather-write in the common case."""
    head = header(kind, msg_id, len(payload))
    sent = sock.sendmsg([head, payload])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < len(payload):
        sock.sendall(memoryview(payload)[sent - len(head) :])
