"""TLS on real servers: the development CA, the protocol policy, bad handshakes refused
cleanly, certificates rotated on a live server without a dropped connection, several workers,
and production's refusal of plain HTTP."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from service.auth.signature import sign_request
from service.edge.devcerts import Issued, issue, make_ca
from service.edge.tls import TLSFileError, TLSFiles, server_context
from tests.conftest import Server, free_port, start_server, stop_server
from tests.test_edge_upgrade import require_tool, run_java

pytestmark = pytest.mark.slow  # live TLS servers


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("tls"), tls=True)
    yield running
    stop_server(running)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*, ca_file: Path | None = None, workers: int = 1, **env: str) -> Server:
        server = start_server(tmp_path / f"s{len(started)}", env, ca_file=ca_file, workers=workers)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_server(server)


def host_port(server: Server) -> tuple[str, int]:
    host, port = server.url.split("://")[1].split(":")
    return host, int(port)


def client_context(
    ca_file: Path | None,
    *,
    minimum: ssl.TLSVersion | None = None,
    maximum: ssl.TLSVersion | None = None,
    ciphers: str | None = None,
    alpn: list[str] | None = None,
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if minimum is not None:
        context.minimum_version = minimum
    if maximum is not None:
        context.maximum_version = maximum
    if ciphers is not None:
        context.set_ciphers(ciphers)
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    return context


def handshake(server: Server, context: ssl.SSLContext) -> ssl.SSLSocket:
    host, port = host_port(server)
    sock = socket.create_connection((host, port), timeout=10)
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def peer_serial(sock: ssl.SSLSocket) -> int:
    der = sock.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def healthz_over(sock: ssl.SSLSocket) -> int:
    """One GET /healthz on an established TLS socket (keep-alive)."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: cryptd\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return int(data.split(b" ", 2)[1])


def assert_still_serving(server: Server) -> None:
    assert server.request("GET", "/healthz", sign=False).status_code == 200


def assert_clean_log(server: Server) -> None:
    log = server.log().split("Started server process", 1)[-1]
    assert "Traceback" not in log
    assert "PRIVATE KEY" not in log
    assert base64.b64encode(server.secret).decode() not in log


# --- serve --dev --tls ---------------------------------------------------------------------


def test_dev_tls_writes_an_https_credential_with_its_ca(tls_server: Server) -> None:
    credential = orjson.loads((tls_server.directory / "dev" / "client.json").read_bytes())
    assert credential["url"].startswith("https://127.0.0.1:")
    assert Path(credential["ca_file"]) == tls_server.ca_file
    cert = x509.load_pem_x509_certificate(
        (tls_server.directory / "dev" / "tls" / "server.crt").read_bytes()
    )
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1"}
    assert oct((tls_server.directory / "dev" / "tls" / "server.key").stat().st_mode)[-3:] == "600"
    encrypted = tls_server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": "aGk="})
    assert encrypted.status_code == 200, encrypted.text
    with pytest.raises(httpx.ConnectError):  # the development CA is not a public one
        httpx.get(tls_server.url + "/healthz", timeout=5)


def test_cryptd_call_reads_the_ca_from_the_credential(tls_server: Server) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "call", "encrypt", "aes256-gcm", "--data", "hi"],
        env={**os.environ, "CRYPTD_DEV_DIR": str(tls_server.directory / "dev")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout)["key_version"] == 1


# --- protocol policy ---------------------------------------------------------------------


def test_tls13_is_preferred_and_tls12_uses_aead_with_forward_secrecy(tls_server: Server) -> None:
    with handshake(tls_server, client_context(tls_server.ca_file)) as sock:
        assert sock.version() == "TLSv1.3"
        # The server's order: AES-128-GCM, where OpenSSL's client offers AES-256-GCM first.
        assert sock.cipher()[0] == "TLS_AES_128_GCM_SHA256"  # type: ignore[index]
        assert healthz_over(sock) == 200
    tls12 = client_context(tls_server.ca_file, maximum=ssl.TLSVersion.TLSv1_2)
    with handshake(tls_server, tls12) as sock:
        assert sock.version() == "TLSv1.2"
        name = sock.cipher()[0]  # type: ignore[index]
        assert name.startswith("ECDHE-"), name
        assert "GCM" in name or "CHACHA20" in name, name
        assert healthz_over(sock) == 200


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1])
def test_old_tls_versions_are_refused_at_the_handshake(
    tls_server: Server, version: ssl.TLSVersion
) -> None:
    # A client willing to speak only the old version (its own defaults forbid it too).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        context = client_context(
            tls_server.ca_file, minimum=version, maximum=version, ciphers="DEFAULT:@SECLEVEL=0"
        )
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        handshake(tls_server, context).close()
    assert_still_serving(tls_server)
    assert_clean_log(tls_server)


@pytest.mark.parametrize("flag", ["-tls1", "-tls1_1"])
def test_openssl_client_with_old_tls_is_refused(tls_server: Server, flag: str) -> None:
    openssl = require_tool("openssl")
    host, port = host_port(tls_server)
    done = subprocess.run(
        [openssl, "s_client", flag, "-cipher", "DEFAULT@SECLEVEL=0", "-connect", f"{host}:{port}"],
        input=b"",
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert b"Cipher is (NONE)" in done.stdout or b"alert" in done.stderr.lower(), done.stderr
    assert_still_serving(tls_server)


def test_suites_without_aead_or_forward_secrecy_are_refused(tls_server: Server) -> None:
    cbc = client_context(
        tls_server.ca_file,
        maximum=ssl.TLSVersion.TLSv1_2,
        ciphers="ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES256-SHA:AES128-GCM-SHA256",
    )
    with pytest.raises(ssl.SSLError):
        handshake(tls_server, cbc).close()
    assert_still_serving(tls_server)


def test_plain_http_to_the_tls_port_is_refused_cleanly(tls_server: Server) -> None:
    host, port = host_port(tls_server)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Marker: plain-77e1\r\n\r\n")
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    assert b"HTTP/1.1" not in received  # no answer in clear text, the connection just ends
    assert_still_serving(tls_server)
    assert "plain-77e1" not in tls_server.log()
    assert_clean_log(tls_server)


def test_alpn_settles_on_http11_for_h2_clients(tls_server: Server) -> None:
    context = client_context(tls_server.ca_file, alpn=["h2", "http/1.1"])
    with handshake(tls_server, context) as sock:
        assert sock.selected_alpn_protocol() == "http/1.1"
        assert healthz_over(sock) == 200


def test_curl_http2_over_tls(tls_server: Server) -> None:
    curl = require_tool("curl")
    body = orjson.dumps({"plaintext": base64.b64encode(b"curl over tls").decode()})
    path = "/v1/encrypt/aes256-gcm"
    args = [curl, "-sS", "-v", "--http2", "--cacert", str(tls_server.ca_file)]
    args += ["--data-binary", "@-", tls_server.url + path]
    headers = sign_request("POST", path, "", body, tls_server.client_id, tls_server.secret)
    for name, value in headers.items():
        args += ["-H", f"{name}: {value}"]
    done = subprocess.run(args, input=body, capture_output=True, timeout=30, check=False)
    assert b"ALPN: server accepted http/1.1" in done.stderr, done.stderr.decode(errors="replace")
    assert b"< HTTP/1.1 200" in done.stderr
    assert orjson.loads(done.stdout)["key_version"] == 1


def test_java_default_client_over_tls_gets_2xx_on_every_route(tls_server: Server) -> None:
    assert tls_server.ca_file is not None
    secret = base64.b64encode(tls_server.secret).decode()
    lines = run_java(tls_server.url, tls_server.client_id, secret, str(tls_server.ca_file))
    assert len(lines) >= 15
    for line in lines:
        status, _, _, version, *_ = line.split(" ", 4)
        assert status in ("200", "201", "204"), line
        assert version == "HTTP_1_1", line  # h2 offered in ALPN, HTTP/1.1 chosen


# --- rotation ------------------------------------------------------------------------------


class Mount:
    """Certificate files laid out as the kubelet mounts a Secret: the names are symlinks into
    ``..data``, itself a symlink to a timestamped directory, swapped atomically on update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.version = 0

    def put(self, cert: bytes, key: bytes, ca: bytes | None = None) -> None:
        self.version += 1
        data = self.root / f"..2026_12_01_{self.version:04d}"
        data.mkdir()
        (data / "tls.crt").write_bytes(cert)
        (data / "tls.key").write_bytes(key)
        if ca is not None:
            (data / "ca.crt").write_bytes(ca)
        link = self.root / "..data_tmp"
        link.symlink_to(data.name)
        os.replace(link, self.root / "..data")
        for name in ("tls.crt", "tls.key", "ca.crt"):
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")

    def env(self) -> dict[str, str]:
        return {
            "CRYPTD_TLS_CERT_FILE": str(self.root / "tls.crt"),
            "CRYPTD_TLS_KEY_FILE": str(self.root / "tls.key"),
        }


def leaf(ca: Issued) -> Issued:
    return issue(ca, ["127.0.0.1", "localhost"])


def wait_for_serial(server: Server, context: ssl.SSLContext, serial: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        with handshake(server, context) as sock:
            if peer_serial(sock) == serial:
                return
        if time.monotonic() > deadline:
            raise AssertionError("the new certificate was not picked up")
        time.sleep(0.2)


def test_certificate_rotated_on_a_live_server_keeps_connections(
    own_server: Callable[..., Server], tmp_path: Path
) -> None:
    ca = make_ca("rotation test CA")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem())
    first, second = leaf(ca), leaf(ca)
    mount = Mount(tmp_path / "tls")
    mount.put(first.cert_pem(), first.key_pem())
    server = own_server(ca_file=tmp_path / "ca.crt", **mount.env())
    context = client_context(tmp_path / "ca.crt")

    kept = handshake(server, context)  # a kept-alive connection across the rotation
    try:
        assert peer_serial(kept) == first.cert.serial_number
        assert healthz_over(kept) == 200

        mount.put(second.cert_pem(), second.key_pem())
        wait_for_serial(server, context, second.cert.serial_number)
        for _ in range(3):
            assert healthz_over(kept) == 200  # not dropped, still on the first certificate
        assert peer_serial(kept) == first.cert.serial_number

        # A half-done rotation (key not matching the certificate) changes nothing ...
        third = leaf(ca)
        mount.put(third.cert_pem(), second.key_pem())
        time.sleep(2.5)
        with handshake(server, context) as sock:
            assert peer_serial(sock) == second.cert.serial_number
        assert "do not load; the previous certificate stays in use" in server.log()
        # ... and the next complete one is taken.
        fourth = leaf(ca)
        mount.put(fourth.cert_pem(), fourth.key_pem())
        wait_for_serial(server, context, fourth.cert.serial_number)
        assert healthz_over(kept) == 200
    finally:
        kept.close()
    # A signed request over a new connection with the rotated certificate.
    assert server.request("POST", "/v1/encrypt/aes256-gcm", {"plaintext": ""}).status_code == 200
    assert_clean_log(server)


def test_several_workers_serve_tls_and_each_reloads(
    own_server: Callable[..., Server], tmp_path: Path, redis_url: str
) -> None:
    ca = make_ca("workers test CA")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem())
    first, second = leaf(ca), leaf(ca)
    mount = Mount(tmp_path / "tls")
    mount.put(first.cert_pem(), first.key_pem())
    server = own_server(
        ca_file=tmp_path / "ca.crt", workers=2, CRYPTD_REDIS_URL=redis_url, **mount.env()
    )
    context = client_context(tmp_path / "ca.crt")
    for _ in range(20):
        assert httpx.get(server.url + "/readyz", verify=context, timeout=10).status_code == 200
    mount.put(second.cert_pem(), second.key_pem())
    time.sleep(2.5)  # every worker checks its files once a second
    serials = set()
    for _ in range(40):  # new connections spread over the workers by address hash
        with handshake(server, context) as sock:
            serials.add(peer_serial(sock))
    assert serials == {second.cert.serial_number}


# --- production ----------------------------------------------------------------------------


def production_env(dev: Path, **extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    return {
        **clean,
        "CRYPTD_ENV": "production",
        "CRYPTD_MASTER_KEY_FILE": str(dev / "master.key"),
        "CRYPTD_KEYRING_FILE": str(dev / "keyring.json"),
        "CRYPTD_CLIENTS_FILE": str(dev / "clients.json"),
        **extra,
    }


def test_production_refuses_plain_http_unless_tls_is_off_on_purpose(
    tls_server: Server, tmp_path: Path
) -> None:
    dev = tls_server.directory / "dev"
    refused = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", str(free_port())],
        env=production_env(dev),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert refused.returncode != 0
    assert "TLS is required" in refused.stderr
    assert "CRYPTD_TLS=off" in refused.stderr

    port = free_port()
    log_path = tmp_path / "off.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            env=production_env(dev, CRYPTD_TLS="off"),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert "TLS is off (CRYPTD_TLS=off)" in log_path.read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)

    with_tls = production_env(
        dev,
        CRYPTD_TLS_CERT_FILE=str(dev / "tls" / "server.crt"),
        CRYPTD_TLS_KEY_FILE=str(dev / "tls" / "server.key"),
        CRYPTD_TLS="off",
    )
    both = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", str(free_port())],
        env=with_tls,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert both.returncode != 0
    assert "choose one" in both.stderr


def test_unusable_certificate_files_fail_at_start(tls_server: Server, tmp_path: Path) -> None:
    dev = tls_server.directory / "dev"
    other = leaf(make_ca("another CA"))
    (tmp_path / "other.key").write_bytes(other.key_pem())
    mismatched = production_env(
        dev,
        CRYPTD_TLS_CERT_FILE=str(dev / "tls" / "server.crt"),
        CRYPTD_TLS_KEY_FILE=str(tmp_path / "other.key"),
    )
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", str(free_port())],
        env=mismatched,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert f"CRYPTD_TLS_KEY_FILE {tmp_path / 'other.key'} does not match" in done.stderr
    assert "PRIVATE KEY" not in done.stderr
    assert "Traceback" not in done.stderr


def _tls_files(root: Path) -> dict[str, Path]:
    """Usable files (a server certificate, its key, a CA) and unusable ones."""
    ca = make_ca("files CA")
    server = leaf(ca)
    encrypted = server.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"),
    )
    contents = {
        "cert": server.cert_pem(),
        "key": server.key_pem(),
        "ca": ca.cert_pem(),
        "other key": leaf(ca).key_pem(),
        "encrypted key": encrypted,
        "empty": b"",
    }
    files = {}
    for name, content in contents.items():
        files[name] = root / name.replace(" ", "-")
        files[name].write_bytes(content)
    files["missing"] = root / "missing.pem"
    return files


@pytest.mark.parametrize(
    ("cert", "key", "ca", "named", "reason"),
    [
        ("missing", "key", None, "CRYPTD_TLS_CERT_FILE", "No such file"),
        ("empty", "key", None, "CRYPTD_TLS_CERT_FILE", "no PEM certificate"),
        ("key", "key", None, "CRYPTD_TLS_CERT_FILE", "no PEM certificate"),
        ("cert", "missing", None, "CRYPTD_TLS_KEY_FILE", "No such file"),
        ("cert", "empty", None, "CRYPTD_TLS_KEY_FILE", "no PEM private key"),
        ("cert", "encrypted key", None, "CRYPTD_TLS_KEY_FILE", "encrypted"),
        ("cert", "other key", None, "CRYPTD_TLS_KEY_FILE", "does not match the certificate"),
        ("cert", "key", "empty", "CRYPTD_TLS_CLIENT_CA_FILE", "does not load"),
        ("cert", "key", "missing", "CRYPTD_TLS_CLIENT_CA_FILE", "No such file"),
    ],
)
def test_a_tls_file_that_does_not_load_is_named_with_its_setting(
    tmp_path: Path, cert: str, key: str, ca: str | None, named: str, reason: str
) -> None:
    files = _tls_files(tmp_path)
    with pytest.raises(TLSFileError) as refused:
        server_context(TLSFiles(files[cert], files[key], files[ca] if ca is not None else None))
    path = {"CRYPTD_TLS_CERT_FILE": cert, "CRYPTD_TLS_KEY_FILE": key}.get(named, ca)
    assert f"{named} {files[path or '']}" in str(refused.value)
    assert reason in str(refused.value)
    assert b"PRIVATE KEY" not in str(refused.value).encode()
    server_context(TLSFiles(files["cert"], files["key"], files["ca"]))  # the good ones load


def _pump(source: ssl.MemoryBIO, target: ssl.MemoryBIO) -> None:
    target.write(source.read())


@pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["TLSv1.2", "TLSv1.3"]
)
def test_server_connections_read_and_write_through_the_c_object(
    tmp_path: Path, version: ssl.TLSVersion
) -> None:
    """The server context's connection objects call the C object directly; a handshake and
    records both ways over memory BIOs (the event loop's way) behave as ssl's own objects."""
    files = _tls_files(tmp_path)
    context = server_context(TLSFiles(files["cert"], files["key"]))
    server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
    server = context.wrap_bio(server_in, server_out, server_side=True)
    inner = server._sslobj  # type: ignore[attr-defined]
    # typeshed types these bound methods as plain callables, without __self__.
    assert (server.read.__self__, server.write.__self__, server.pending.__self__) == (inner,) * 3  # type: ignore[attr-defined]
    client = client_context(files["ca"], minimum=version, maximum=version).wrap_bio(
        client_in, client_out, server_hostname="localhost"
    )
    for _ in range(10):
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        _pump(client_out, server_in)
        _pump(server_out, client_in)
    assert server.version() == client.version() == version.name.replace("_", ".")
    with pytest.raises(ssl.SSLWantReadError):
        server.read(1024)
    client.write(b"request " * 100)
    _pump(client_out, server_in)
    assert server.read(10) == b"request re"
    assert server.pending() == 790
    buffer = bytearray(1000)
    # With a buffer, read() returns the count (typeshed knows only the bytes it returns alone).
    assert server.read(1000, buffer) == 790  # type: ignore[comparison-overlap]
    assert bytes(buffer[:790]) == (b"request " * 100)[10:]
    assert server.write(b"answer") == 6
    _pump(server_out, client_in)
    assert client.read(100) == b"answer"


def test_a_refused_configuration_never_prints_the_settings(tmp_path: Path) -> None:
    """pydantic's error text quotes every setting it was given; the CLI prints the reasons only."""
    master = base64.b64encode(bytes(range(32))).decode()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    env.update(CRYPTD_ENV="production", CRYPTD_MASTER_KEY=master, CRYPTD_CLIENTS_FILE="c.json")
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "TLS is required" in done.stderr
    assert master not in done.stderr
    assert master[:8] not in done.stderr
    assert "input_value" not in done.stderr
