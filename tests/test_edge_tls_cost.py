"""What the server side does to make a TLS request cheap, over memory BIOs (the event loop's
way, no server needed): AES-128-GCM first among the TLS 1.3 suites unless the OpenSSL
configuration says otherwise, the libssl binding that sets what Python's ``ssl`` module cannot,
and uvloop's 256 KiB reads served from the heap instead of a fresh mapping each."""

from __future__ import annotations

import contextlib
import os
import platform
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from service.edge import _libssl
from service.edge.devcerts import ensure_dev_tls
from service.edge.tls import TLS13_SUITES, TLSFiles, server_context

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[TLSFiles, Path]:
    dev = ensure_dev_tls(tmp_path_factory.mktemp("tls"))
    return TLSFiles(dev.cert_file, dev.key_file), dev.ca_file


def _connect(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> tuple[ssl.SSLObject, ssl.SSLObject, list[ssl.MemoryBIO]]:
    server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx.wrap_bio(server_in, server_out, server_side=True)
    client = client_ctx.wrap_bio(client_in, client_out, server_hostname="localhost")
    for _ in range(10):
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        server_in.write(client_out.read())
        client_in.write(server_out.read())
    return server, client, [server_in, server_out, client_in, client_out]


def _tls13(context: ssl.SSLContext) -> list[str]:
    return [c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.3"]


def test_tls13_prefers_aes128_gcm_and_keeps_the_other_aead_suites(
    files: tuple[TLSFiles, Path],
) -> None:
    context = server_context(files[0])
    assert _tls13(context) == TLS13_SUITES.split(":")
    client = ssl.create_default_context(cafile=files[1])
    server, _, _ = _connect(context, client)
    # OpenSSL's client offers AES-256-GCM first; the server's order decides.
    assert server.cipher()[0] == "TLS_AES_128_GCM_SHA256"  # type: ignore[index]
    # A client that offers only AES-256-GCM still gets it.
    only256 = ssl.create_default_context(cafile=files[1])
    _libssl.set_tls13_suites(only256, "TLS_AES_256_GCM_SHA384")
    server, _, _ = _connect(context, only256)
    assert server.cipher()[0] == "TLS_AES_256_GCM_SHA384"  # type: ignore[index]


def test_the_openssl_configuration_keeps_the_operators_order(
    files: tuple[TLSFiles, Path], tmp_path: Path
) -> None:
    conf = tmp_path / "openssl.cnf"
    conf.write_text(
        "openssl_conf = init\n[init]\nssl_conf = ssl\n[ssl]\nsystem_default = defaults\n"
        "[defaults]\nCiphersuites = TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384\n"
    )
    code = (
        "import sys; from pathlib import Path; from service.edge.tls import TLSFiles, "
        "server_context; c = server_context(TLSFiles(Path(sys.argv[1]), Path(sys.argv[2]))); "
        "print(':'.join(x['name'] for x in c.get_ciphers() if x['protocol'] == 'TLSv1.3'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(files[0].cert_file), str(files[0].key_file)],
        env={**os.environ, "OPENSSL_CONF": str(conf)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384"


_READS = """
import contextlib, resource, ssl, sys
from pathlib import Path
from service.edge.tls import TLSFiles, server_context
if sys.argv[4] == "cryptd":
    context = server_context(TLSFiles(Path(sys.argv[1]), Path(sys.argv[2])))
else:  # ssl's own
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[1], sys.argv[2])
server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
server = context.wrap_bio(server_in, server_out, server_side=True)
client = ssl.create_default_context(cafile=sys.argv[3]).wrap_bio(
    client_in, client_out, server_hostname="localhost")
for _ in range(10):
    for side in (client, server):
        with contextlib.suppress(ssl.SSLWantReadError):
            side.do_handshake()
    server_in.write(client_out.read())
    client_in.write(server_out.read())
records = []
for _ in range(500):
    client.write(b"r" * 1400)
    records.append(client_out.read())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for record in records:
    server_in.write(record)
    assert server.read(256 * 1024) == b"r" * 1400  # what uvloop asks for
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mmap threshold")
def test_uvloops_256_kib_reads_stop_mapping_a_fresh_page_each(
    files: tuple[TLSFiles, Path],
) -> None:
    def faults(mode: str) -> int:
        args = [str(files[0].cert_file), str(files[0].key_file), str(files[1]), mode]
        done = subprocess.run(
            [sys.executable, "-c", _READS, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return int(done.stdout)

    # With ssl's own context each 256 KiB bytes object is a new mapping whose written page
    # faults in; once cryptd's server context has raised the threshold, heap pages are reused.
    assert faults("ssl") >= 500
    assert faults("cryptd") < 50


def test_libssl_refuses_an_unknown_suite_and_leaves_the_context_as_it_was(
    files: tuple[TLSFiles, Path],
) -> None:
    context = server_context(files[0])
    before = _tls13(context)
    with pytest.raises(_libssl.LibsslError, match="refused"):
        _libssl.set_tls13_suites(context, "TLS_NOT_A_SUITE")
    assert _tls13(context) == before
    # OpenSSL's error queue was emptied: the next call on this thread sees no stale error.
    _libssl.set_tls13_suites(context, "TLS_AES_128_GCM_SHA256")
    assert _tls13(context) == ["TLS_AES_128_GCM_SHA256"]
