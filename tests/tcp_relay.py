"""Bytes from one socket to another, for the tests' TCP proxies in front of real servers."""

from __future__ import annotations

import contextlib
import socket
import threading


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


class Relay:
    """A TCP relay to ``upstream`` (a port on 127.0.0.1) through a listening port of its own,
    which the test can cut (every connection ended, new ones refused) and restore."""

    def __init__(self, upstream: int) -> None:
        self._upstream = upstream
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._serve(self._listener)

    def _serve(self, listener: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._upstream))
            except OSError:
                conn.close()
                continue
            with self._lock:
                self._sockets += [conn, upstream]
            for source, sink in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pipe, args=(source, sink), daemon=True).start()

    def cut(self) -> None:
        """End every connection through the relay and refuse new ones."""
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pipe blocked on it
            sock.close()

    def restore(self) -> None:
        """Accept connections on the same port again."""
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._serve(self._listener)

    close = cut
