"""Bytes from one socket to another, for the tests' TCP proxies in front of real servers."""

from __future__ import annotations

import contextlib
import socket


def pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends or fails, then end ``sink``'s
    sending side and close ``source`` (run in a thread of its own, one per direction)."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        source.close()
