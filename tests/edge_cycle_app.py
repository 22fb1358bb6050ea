"""The app tests/test_edge_cycle.py serves twice, in a process of its own (under pytest,
uvicorn's access logger has pytest's handlers, which would turn uvicorn's access log on):

    python -m tests.edge_cycle_app edge|uvicorn PORT

It answers ``/v1/<case>`` as :data:`CASES` says, or sends the refused header field of
:data:`REFUSED`; ``/errors/<case>`` answers what that refusal raised in the app's ``send``,
``/names`` the header names the edge's fast head has learnt (none under uvicorn's own).
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
import uvloop

from service.edge import response
from service.edge.protocol import EdgeLimits
from service.edge.server import EdgeConfig, EdgeServer, bind

BODY = b'{"ciphertext":"' + b"A" * 1400 + b'"}'
LENGTH = str(len(BODY)).encode()
PLAIN = [
    (b"content-type", b"application/json"),
    (b"content-length", LENGTH),
    (b"x-request-id", b"01JF3Q8W5M6Y7Z9A0B1C2D3E4F"),
]

# Each case: the status, the header fields and the body parts the app sends.
CASES: dict[str, tuple[int, Any, list[bytes]]] = {
    "plain": (200, PLAIN, [BODY]),
    "tuple-headers": (200, tuple(PLAIN), [BODY]),
    "body-in-parts": (200, PLAIN, [BODY[:100], BODY[100:]]),
    "mixed-case-names": (
        200,
        [(b"Content-Type", b"application/json"), (b"Content-Length", LENGTH)],
        [BODY],
    ),
    "bytearray-value": (200, [(b"content-length", LENGTH), (b"x-a", bytearray(b"1"))], [BODY]),
    "tab-in-value": (200, [(b"content-length", LENGTH), (b"x-a", b"a\tb")], [BODY]),
    "two-lengths": (200, [(b"content-length", LENGTH), (b"content-length", LENGTH)], [BODY]),
    "no-length": (200, [(b"content-type", b"application/json")], [BODY[:10], BODY[10:]]),
    "chunked": (200, [(b"transfer-encoding", b"chunked")], [BODY]),
    "connection-close": (200, [*PLAIN, (b"connection", b"close")], [BODY]),
    "no-headers": (200, [], [b""]),
    "204": (204, [], [b""]),
    "304": (304, [(b"etag", b'"1"')], [b""]),
    "599": (599, [(b"content-length", b"2")], [b"ok"]),
    "digits-with-space": (200, [(b"content-length", b" 2")], [b"ok"]),
}
# Header fields uvicorn refuses (RuntimeError in the app's send, the connection closed).
REFUSED: dict[str, tuple[bytes, bytes]] = {
    "space-in-name": (b"x a", b"1"),
    "colon-in-name": (b"x:a", b"1"),
    "crlf-in-name": (b"x\r\ny", b"1"),
    "crlf-in-value": (b"x-a", b"1\r\nset-cookie: a=b"),
    "lf-in-value": (b"x-a", b"1\nb"),
    "cr-in-value": (b"x-a", b"1\rb"),
    "nul-in-value": (b"x-a", b"1\x00"),
    "del-in-value": (b"x-a", b"\x7f"),
    "crlf-in-length": (b"content-length", b"2\r\nx: y"),
    "bad-length": (b"content-length", b"abc"),
}


class Recorder:
    """The app both servers run; it keeps the errors its ``send`` raised, by case."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        case = scope["path"].rsplit("/", 1)[-1]
        if scope["path"] == "/names":  # what the edge's fast head has learnt
            names = b",".join(sorted(response._PLAIN_NAMES))
            headers = [(b"content-length", str(len(names)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": names})
            return
        if scope["path"].startswith("/errors/"):
            error = self.errors.get(case, "").encode()
            headers = [(b"content-length", str(len(error)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": error})
            return
        if case in REFUSED:
            headers = [REFUSED[case], (b"content-length", b"2")]
            try:
                await send({"type": "http.response.start", "status": 200, "headers": headers})
            except Exception as exc:
                self.errors[case] = repr(exc)
                raise
            return
        status, headers, parts = CASES[case]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for index, part in enumerate(parts):
            more = index < len(parts) - 1
            await send({"type": "http.response.body", "body": part, "more_body": more})


def main(kind: str, port: int) -> None:
    options: dict[str, Any] = {
        "lifespan": "off",
        "log_config": None,
        "access_log": False,
        "server_header": True,  # a default field besides Date
    }
    app = Recorder()
    server: uvicorn.Server
    if kind == "edge":
        server = EdgeServer(EdgeConfig(app, edge=EdgeLimits(), **options))
    else:
        server = uvicorn.Server(uvicorn.Config(app, http="httptools", ws="none", **options))
    uvloop.run(server.serve(sockets=[bind("127.0.0.1", port)]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
