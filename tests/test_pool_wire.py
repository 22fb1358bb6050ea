"""Framing between the parent and its worker processes, and what errors may cross it."""

from __future__ import annotations

import io
import socket
import threading

import pytest

from service.errors import DecryptionFailed, Internal, KeyNotFound, Overloaded
from service.pool.channel import RECEIVE_BUFFER, FrameProtocol
from service.pool.process import decode_error
from service.pool.wire import HEADER, Kind, ProtocolError, dumps, header, read_frame, write_frame
from service.pool.worker import encode_error

PAYLOAD_SIZES = [0, 1, HEADER.size, 4096, RECEIVE_BUFFER - HEADER.size, RECEIVE_BUFFER, 700_000]


def _stream(frames: list[tuple[Kind, int, bytes]]) -> bytes:
    return b"".join(header(kind, msg_id, len(body)) + body for kind, msg_id, body in frames)


def _feed(stream: bytes, chunk: int) -> tuple[list[tuple[Kind, int, bytes]], FrameProtocol]:
    got: list[tuple[Kind, int, bytes]] = []
    proto = FrameProtocol(lambda k, i, p: got.append((k, i, bytes(p))), lambda: None)
    pos = 0
    while pos < len(stream):
        buf = proto.get_buffer(-1)
        assert len(buf) > 0
        n = min(len(buf), chunk, len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        buf.release()
        proto.buffer_updated(n)
        pos += n
    return got, proto


def _frames() -> list[tuple[Kind, int, bytes]]:
    return [
        (Kind.RESULT, i + 1, bytes((i + j) % 251 for j in range(size)))
        for i, size in enumerate(PAYLOAD_SIZES)
    ]


@pytest.mark.parametrize("chunk", [1, 7, 4096, 65536, 1 << 30])
def test_frames_survive_any_chunking(chunk: int) -> None:
    frames = _frames()
    if chunk == 1:  # byte by byte over 1.3 MB is slow; the small frames cover the edge cases
        frames = frames[:4]
    got, _ = _feed(_stream(frames), chunk)
    assert got == frames


def test_many_small_frames_in_one_read() -> None:
    frames = [(Kind.RESULT, i, i.to_bytes(4, "big") * (i % 5)) for i in range(1, 2000)]
    got, _ = _feed(_stream(frames), 1 << 30)
    assert got == frames


def test_unknown_frame_kind_aborts_the_channel() -> None:
    bad = HEADER.pack(3, 1, 99) + b"abc"
    got, proto = _feed(bad, 1 << 30)
    assert got == []
    assert proto.closed


def test_absurd_length_is_refused() -> None:
    with pytest.raises(ProtocolError):
        read_frame(io.BytesIO(HEADER.pack(1 << 40, 1, Kind.TASK)))


def test_truncated_frame_is_an_error_and_clean_eof_is_none() -> None:
    whole = header(Kind.TASK, 5, 10) + b"0123456789"
    assert read_frame(io.BytesIO(b"")) is None
    with pytest.raises(ProtocolError):
        read_frame(io.BytesIO(whole[:-1]))
    with pytest.raises(ProtocolError):
        read_frame(io.BytesIO(whole[:5]))


def test_blocking_side_round_trips_large_frames_over_a_socket() -> None:
    left, right = socket.socketpair()
    frames = _frames()
    with left, right, right.makefile("rb") as reader:
        # Written from a thread: a frame larger than the socket buffer needs a reader meanwhile.
        def write_all() -> None:
            for frame in frames:
                write_frame(left, *frame)

        writer = threading.Thread(target=write_all)
        writer.start()
        got = [read_frame(reader) for _ in frames]
        writer.join()
    assert got == frames


def test_domain_errors_cross_unchanged() -> None:
    for exc in (DecryptionFailed(), KeyNotFound("no such key"), Overloaded("busy", retry_after=7)):
        back = decode_error(memoryview(encode_error(exc)))
        assert type(back) is type(exc)
        assert str(back) == str(exc)
    back = decode_error(memoryview(encode_error(Overloaded("busy", retry_after=7))))
    assert isinstance(back, Overloaded)
    assert back.retry_after == 7


class _NeedsTwoArgs(Exception):
    def __init__(self, secret: str, other: str) -> None:
        super().__init__(f"{secret} {other}")  # unpickling calls __init__(message): fails


def test_unpicklable_error_becomes_generic_internal() -> None:
    for exc in (_NeedsTwoArgs("hunter2", "x"), ValueError(lambda: "hunter2")):
        back = decode_error(memoryview(encode_error(exc)))
        assert type(back) is Internal
        assert "hunter2" not in str(back)


def test_interpreter_exits_never_cross() -> None:
    back = decode_error(memoryview(encode_error(SystemExit(3))))
    assert type(back) is Internal


def test_garbage_error_payload_becomes_internal() -> None:
    assert type(decode_error(memoryview(b"not a pickle"))) is Internal
    assert type(decode_error(memoryview(dumps("a string, not an exception")))) is Internal
