"""The HTTP ceiling: a bare ASGI app under the server cryptd runs on (uvicorn, uvloop, httptools).

It reads the request body and answers every request with the same ~1.4 KB JSON body (the size
of an AES-GCM 1 KiB encrypt answer), doing nothing else: whatever a request costs it is what
the HTTP server itself costs. The runner measures it with the same signing load generator as
cryptd on the same CPU; cryptd's own work per request is the difference of the two.

    python -m loadtest.bare --port 8090
    python -m loadtest.bare --port 8443 --tls-cert server.crt --tls-key server.key

With a certificate it serves HTTPS with cryptd's own TLS context (service/edge/tls.py: the same
versions, suites and options), so that against cryptd over TLS the only difference left is what
cryptd does with a request.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

BODY: Final = b'{"ciphertext":"cryptd:v1:' + b"A" * 1390 + b'","key_version":1}'
_START: Final = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ],
}
_BODY: Final = {"type": "http.response.body", "body": BODY}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        return
    more = True
    while more:  # the whole body, as any real endpoint must read it
        message = await receive()
        more = message.get("more_body", False)
    await send(_START)
    await send(_BODY)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m loadtest.bare", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls-cert", type=Path, help="certificate chain (PEM): serve HTTPS")
    parser.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    args = parser.parse_args(argv)
    tls: dict[str, Any] = {}
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert is not None:
        from service.edge.tls import TLSFiles, server_context

        files = TLSFiles(args.tls_cert, args.tls_key)
        tls["ssl_context_factory"] = lambda _config, _default: server_context(files)
    uvicorn.run(
        "loadtest.bare:app",
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        proxy_headers=False,
        **tls,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
