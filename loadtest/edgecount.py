"""Instructions the HTTP edge spends per request (callgrind), without the crypto behind it.

A cryptd-like ASGI app (it reads the body and answers the two messages ``CryptoDispatch``
sends for a 200: ``http.response.start`` with Content-Type, Content-Length and X-Request-ID,
then one ``http.response.body`` of ~1.4 KB) is served by cryptd's own ``EdgeConfig`` and
``EdgeServer`` (``EdgeProtocol`` on uvloop and httptools) on 127.0.0.1, in a process run
under ``valgrind --tool=callgrind``. A client outside valgrind sends signed-shaped
``POST /v1/encrypt/aes256-gcm`` requests with a 1.4 KB JSON body over ``--concurrency``
keep-alive connections. The server process is run twice, for ``--low`` and ``--high``
requests after the same warm-up, and the difference of the two totals over the difference
in requests is what one request costs the server process (event loop, parser, protocol,
response cycle, and the app's few lines).

``--tls`` serves HTTPS with cryptd's own TLS setup (``TLSFactory`` on a development certificate,
as ``cryptd serve --dev --tls`` runs): the connections' handshakes are the same in both runs,
so the difference is what TLS adds to each request once a connection is open (records opened
and sealed, the TLS layer's reads and writes); compare it with the figure without ``--tls``.

uvicorn's once-a-tenth-of-a-second tick is not run (it would add instructions in
proportion to the wall time valgrind takes): the server's default headers (Date) are set
once, by one tick's worth of work, before the requests start.

    python -m loadtest.edgecount
    python -m loadtest.edgecount --low 300 --high 1300 --repeats 3
    python -m loadtest.edgecount --tls
"""

from __future__ import annotations

import argparse
import asyncio
import re
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

BODY: Final = b'{"ciphertext":"cryptd:v1:' + b"A" * 1390 + b'","key_version":1}'
REQUEST_ID: Final = b"01JF3Q8W5M6Y7Z9A0B1C2D3E4F"
PLAINTEXT: Final = b'{"plaintext":"' + b"QUFB" * 342 + b'","aad":"Y3J5cHRk"}'
_TOTALS: Final = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def request_bytes() -> bytes:
    """One request as the load generator sends it: the signature's four header fields (made
    by the client library with a throwaway secret; nothing here checks them) and the body."""
    from cryptd_client.signing import sign_request

    path = "/v1/encrypt/aes256-gcm"
    fields = sign_request("POST", path, "", PLAINTEXT, "bench-client", b"\x01" * 32)
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "User-Agent: cryptd-edgecount"]
    head += [f"{name}: {value}" for name, value in fields.items()]
    head.append(f"Content-Length: {len(PLAINTEXT)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + PLAINTEXT


def _announce(port_file: Path, port: int) -> None:
    """Tell the driver the port (once the server listens)."""
    port_file.write_text(str(port))


def _dev_tls(directory: Path) -> Any:
    """The development CA and server certificate in ``directory`` (made once)."""
    from service.edge.devcerts import ensure_dev_tls

    return ensure_dev_tls(directory)


async def _serve(port_file: Path, requests: int, tls_dir: Path | None) -> None:
    from service.edge.protocol import EdgeLimits
    from service.edge.server import EdgeConfig, EdgeServer, bind
    from service.edge.tls import TLSFactory, TLSFiles

    done = asyncio.Event()
    answered = 0
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"x-request-id", REQUEST_ID),
    ]
    start = {"type": "http.response.start", "status": 200, "headers": headers}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal answered
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        # A fresh message each time, as the dispatcher builds one per answer.
        await send({**start, "headers": list(headers)})
        await send({"type": "http.response.body", "body": BODY})
        answered += 1
        if answered == requests:
            done.set()

    config = EdgeConfig(
        app,
        edge=EdgeLimits(),
        loop="uvloop",
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level="warning",
        server_header=False,
        proxy_headers=False,
    )
    if tls_dir is not None:
        dev = _dev_tls(tls_dir)
        config.ssl_context_factory = TLSFactory(TLSFiles(dev.cert_file, dev.key_file))
    config.load()
    server = EdgeServer(config)
    server.lifespan = config.lifespan_class(config)
    sock = bind("127.0.0.1", 0)
    await server.startup(sockets=[sock])
    await server.on_tick(0)  # the Date header, as the first tick sets it
    _announce(port_file, sock.getsockname()[1])
    await done.wait()
    server.should_exit = True
    await server.shutdown(sockets=[sock])


async def _drive(
    port: int, requests: int, concurrency: int, tls: ssl.SSLContext | None = None
) -> None:
    request = request_bytes()
    remaining = requests

    async def connection() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
        try:
            while remaining > 0:
                remaining -= 1
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200 "):
                    raise RuntimeError(f"unexpected answer: {head[:100]!r}")
                length = re.search(rb"\r\ncontent-length: (\d+)\r\n", head)
                if length is None:
                    raise RuntimeError(f"no content-length: {head!r}")
                await reader.readexactly(int(length.group(1)))
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))


def run_once(requests: int, concurrency: int, scratch: Path, tls: bool = False) -> int:
    """Total instructions of a server process that answers ``requests`` requests (over TLS
    with a development certificate in ``scratch`` when ``tls``)."""
    out = scratch / f"callgrind.{requests}"
    port_file = scratch / "port"
    port_file.unlink(missing_ok=True)
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "loadtest.edgecount",
        "--serve",
        f"{port_file}:{requests}",
    ]
    client = None
    if tls:
        command += ["--serve-tls", str(scratch / "dev")]
        client = ssl.create_default_context(cafile=_dev_tls(scratch / "dev").ca_file)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server under callgrind did not start")
            time.sleep(0.1)
        asyncio.run(_drive(int(port_file.read_text()), requests, concurrency, client))
        _, stderr = server.communicate(timeout=300)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if server.returncode != 0:
        raise RuntimeError(f"callgrind run failed: {stderr.decode()[-2000:]}")
    found = _TOTALS.search(out.read_text())
    if found is None:
        raise RuntimeError("no totals in the callgrind output")
    return int(found.group(1))


def instructions(
    *, low: int = 200, high: int = 1200, concurrency: int = 16, warmup: int = 300, tls: bool = False
) -> float:
    """Instructions per request of the server process, from runs of ``warmup + low`` and
    ``warmup + high`` requests (over TLS when ``tls``)."""
    with tempfile.TemporaryDirectory(prefix="cryptd-edgecount-") as scratch:
        counts = [run_once(warmup + n, concurrency, Path(scratch), tls) for n in (low, high)]
    return (counts[1] - counts[0]) / (high - low)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.edgecount", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--low", type=int, default=200)
    parser.add_argument("--high", type=int, default=1200)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="measurements, each printed")
    parser.add_argument("--tls", action="store_true", help="serve HTTPS (cryptd's TLS setup)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--serve-tls", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        port_file, requests = args.serve.rsplit(":", 1)
        uvloop.run(_serve(Path(port_file), int(requests), args.serve_tls))
        return 0
    for _ in range(args.repeats):
        count = instructions(
            low=args.low,
            high=args.high,
            concurrency=args.concurrency,
            warmup=args.warmup,
            tls=args.tls,
        )
        print(f"{count:,.0f} instructions per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
