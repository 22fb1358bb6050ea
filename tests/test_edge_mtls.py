"""Mutual TLS on a real server: client certificates required at the handshake, identities
bound to clients, clients authenticated by their certificate alone (curl --cert), and the bad
certificates refused cleanly."""

from __future__ import annotations

import base64
import datetime
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from service.auth.signature import sign_request
from service.edge.devcerts import Issued, issue, make_ca
from tests.conftest import Server, start_server, stop_server
from tests.test_edge_tls import assert_clean_log, client_context, handshake
from tests.test_edge_upgrade import require_tool

pytestmark = pytest.mark.slow  # live TLS servers

BODY = orjson.dumps({"plaintext": base64.b64encode(b"over mutual TLS").decode()})


@dataclass
class Pki:
    root: Path
    ca: Issued

    def write(self, name: str, issued: Issued) -> tuple[Path, Path]:
        cert, key = self.root / f"{name}.crt", self.root / f"{name}.key"
        cert.write_bytes(issued.cert_pem())
        key.write_bytes(issued.key_pem())
        key.chmod(0o600)
        return cert, key

    def client(self, name: str, *identities: str, **options: object) -> tuple[Path, Path]:
        return self.write(name, issue(self.ca, identities, server=False, client=True, **options))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca("mTLS test CA")
    (root / "ca.crt").write_bytes(ca.cert_pem())
    return Pki(root, ca)


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cert, key = pki.write("server", issue(pki.ca, ["127.0.0.1", "localhost"]))
    env = {
        "CRYPTD_TLS_CERT_FILE": str(cert),
        "CRYPTD_TLS_KEY_FILE": str(key),
        "CRYPTD_TLS_CLIENT_CA_FILE": str(pki.root / "ca.crt"),
    }
    directory = tmp_path_factory.mktemp("mtls")
    # Readiness is polled with a client certificate: start_server's own poll has none, so the
    # server is started with the dev client's certificate known to the test's context.
    (directory / "dev").mkdir()
    server = start_mtls(directory, env, pki)
    clients = directory / "dev" / "clients.json"
    for args in (
        ["bound", "--allow", "*:*", "--certificate", "spiffe://test.example/bound"],
        [
            "svc",
            "--allow",
            "aes256-gcm:encrypt",
            "--certificate",
            "spiffe://test.example/svc",
            "--certificate-only",
        ],
        [
            "app",
            "--allow",
            "aes256-gcm:encrypt,decrypt",
            "--certificate",
            "spiffe://test.example/app",
            "--certificate-only",
        ],
    ):
        done = cryptd("clients", "add", *args, "--file", str(clients))
        assert done.returncode == 0, done.stderr
        if args[0] == "bound":
            (directory / "bound.secret").write_text(done.stdout.split()[0])
    time.sleep(1.5)  # the clients file is re-read within a second
    yield server
    stop_server(server)


def cryptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def start_mtls(directory: Path, env: dict[str, str], pki: Pki) -> Server:
    """start_server, with its readiness poll presenting a client certificate."""
    cert, key = pki.client("probe", "spiffe://test.example/probe")
    original = ssl.create_default_context

    def with_client_cert(*args: object, **kwargs: object) -> ssl.SSLContext:
        context = original(*args, **kwargs)  # type: ignore[arg-type]
        context.load_cert_chain(cert, key)
        return context

    ssl.create_default_context = with_client_cert
    try:
        return start_server(directory, env, ca_file=pki.root / "ca.crt")
    finally:
        ssl.create_default_context = original


def context_with(pki: Pki, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    context = client_context(pki.root / "ca.crt")
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    return context


def assert_refused(server: Server, context: ssl.SSLContext) -> None:
    """The server refuses the client's certificate during the handshake. With TLS 1.2 the
    client's handshake fails; with TLS 1.3 the client has sent its Finished already and sees
    the refusal on its first read: an alert or the connection closed, never an answer."""
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        handshake(server, context).close()
    context.maximum_version = ssl.TLSVersion.TLSv1_3
    try:
        sock = handshake(server, context)
    except (ssl.SSLError, ConnectionResetError):
        return
    with sock:
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536) == b""
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            pass


def signed_post(
    server: Server, context: ssl.SSLContext, client_id: str, secret: bytes
) -> httpx.Response:
    path = "/v1/encrypt/aes256-gcm"
    headers = sign_request("POST", path, "", BODY, client_id, secret)
    return httpx.post(server.url + path, content=BODY, headers=headers, verify=context, timeout=30)


def test_no_client_certificate_is_refused_at_the_handshake(mtls_server: Server, pki: Pki) -> None:
    assert_refused(mtls_server, context_with(pki, None, None))
    with pytest.raises(httpx.TransportError):
        signed_post(mtls_server, context_with(pki, None, None), "dev", mtls_server.secret)


def test_certificate_from_another_ca_is_refused_at_the_handshake(
    mtls_server: Server, pki: Pki, tmp_path: Path
) -> None:
    other = Pki(tmp_path, make_ca("another CA"))
    cert, key = other.client("stranger", "spiffe://test.example/bound")
    assert_refused(mtls_server, context_with(pki, cert, key))


def test_expired_client_certificate_is_refused(mtls_server: Server, pki: Pki) -> None:
    now = datetime.datetime.now(datetime.UTC)
    cert, key = pki.client(
        "expired",
        "spiffe://test.example/bound",
        not_before=now - datetime.timedelta(days=30),
        not_after=now - datetime.timedelta(days=1),
    )
    assert_refused(mtls_server, context_with(pki, cert, key))
    # and the server goes on serving the others
    good = context_with(pki, *pki.client("after-expired", "spiffe://test.example/x"))
    assert signed_post(mtls_server, good, "dev", mtls_server.secret).status_code == 200
    assert_clean_log(mtls_server)


def test_a_signing_client_without_listed_certificates_uses_any_valid_one(
    mtls_server: Server, pki: Pki
) -> None:
    context = context_with(pki, *pki.client("any", "spiffe://test.example/anything"))
    assert signed_post(mtls_server, context, "dev", mtls_server.secret).status_code == 200


def test_signature_over_another_identitys_certificate_is_401(mtls_server: Server, pki: Pki) -> None:
    secret = base64.b64decode((mtls_server.directory / "bound.secret").read_text())
    own = context_with(pki, *pki.client("bound", "spiffe://test.example/bound"))
    assert signed_post(mtls_server, own, "bound", secret).status_code == 200
    other = context_with(pki, *pki.client("not-bound", "spiffe://test.example/svc"))
    refused = signed_post(mtls_server, other, "bound", secret)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthenticated"
    deadline = time.monotonic() + 5  # log lines are written by a thread
    while "reason=certificate_mismatch" not in mtls_server.log():
        assert time.monotonic() < deadline, mtls_server.log()[-2000:]
        time.sleep(0.1)


def test_certificate_only_client_with_curl(mtls_server: Server, pki: Pki) -> None:
    curl = require_tool("curl")
    cert, key = pki.client("svc", "spiffe://test.example/svc")
    base = [curl, "-sS", "--cacert", str(pki.root / "ca.crt"), "--cert", str(cert)]
    base += ["--key", str(key), "-o", "-", "-w", "\n%{http_code}"]

    def call(path: str, *extra: str) -> tuple[int, bytes]:
        done = subprocess.run(
            [*base, *extra, mtls_server.url + path],
            capture_output=True,
            timeout=30,
            check=False,
        )
        body, _, status = done.stdout.rpartition(b"\n")
        return int(status), body

    json = ["-H", "Content-Type: application/json", "--data-binary", BODY.decode()]
    status, body = call("/v1/encrypt/aes256-gcm", *json)
    assert status == 200, body
    assert orjson.loads(body)["key_version"] == 1
    # policies apply: the rule allows encrypt on aes256-gcm only
    status, body = call("/v1/encrypt/sm4-gcm", *json)
    assert status == 403, body
    # curl -d says application/x-www-form-urlencoded unless told otherwise
    status, body = call("/v1/encrypt/aes256-gcm", "--data-binary", BODY.decode())
    assert status == 415, body
    # a certificate that names no certificate-only client
    stranger, stranger_key = pki.client("nobody", "spiffe://test.example/nobody")
    done = subprocess.run(
        [
            *(curl, "-sS", "--cacert", str(pki.root / "ca.crt"), "--cert", str(stranger)),
            *("--key", str(stranger_key), "-o", "/dev/null", "-w", "%{http_code}"),
            *json,
            mtls_server.url + "/v1/encrypt/aes256-gcm",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.stdout == "401"


def test_a_uri_san_is_not_the_dns_name_of_the_same_spelling(mtls_server: Server, pki: Pki) -> None:
    """A client listed by the DNS name certonly.example is not authenticated by a certificate
    whose URI SAN reads certonly.example: identities match with their type."""
    clients = mtls_server.directory / "dev" / "clients.json"
    args = ["--allow", "aes256-gcm:encrypt", "--certificate", "certonly.example"]
    done = cryptd("clients", "add", "certonly", *args, "--certificate-only", "--file", str(clients))
    assert done.returncode == 0, done.stderr
    time.sleep(1.5)  # the clients file is re-read within a second

    def unsigned_post(name: str, san: x509.GeneralName) -> int:
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(pki.ca.cert.subject)
            .public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .sign(pki.ca.key, hashes.SHA256())
        )
        cert_path, key_path = pki.root / f"{name}.crt", pki.root / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            leaf_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        response = httpx.post(
            mtls_server.url + "/v1/encrypt/aes256-gcm",
            content=BODY,
            headers={"Content-Type": "application/json"},
            verify=context_with(pki, cert_path, key_path),
            timeout=30,
        )
        return response.status_code

    assert unsigned_post("uri-spelled", x509.UniformResourceIdentifier("certonly.example")) == 401
    assert unsigned_post("dns-named", x509.DNSName("certonly.example")) == 200


def test_certificate_only_client_cannot_sign(mtls_server: Server, pki: Pki) -> None:
    context = context_with(pki, *pki.client("svc2", "spiffe://test.example/svc"))
    # It has no secret: a signature under its id verifies against nothing.
    assert signed_post(mtls_server, context, "svc", os.urandom(32)).status_code == 401


def test_clients_add_refuses_what_the_server_would_refuse(tmp_path: Path) -> None:
    clients = tmp_path / "clients.json"
    done = cryptd("clients", "add", "x", "--certificate-only", "--file", str(clients))
    assert done.returncode != 0
    assert "needs 'certificates'" in done.stderr
    done = cryptd("clients", "add", "x", "--certificate", "not a name", "--file", str(clients))
    assert done.returncode != 0
    for name in ("a", "b"):
        args = ["--certificate", "spiffe://t/one", "--certificate-only"]
        done = cryptd("clients", "add", name, *args, "--file", str(clients))
    assert done.returncode != 0  # two certificate-only clients for one identity
    listed = orjson.loads(cryptd("clients", "list", "--file", str(clients)).stdout)
    assert listed["clients"] == [
        {
            "client_id": "a",
            "admin": False,
            "allow": [],
            "certificates": ["spiffe://t/one"],
            "authentication": "certificate",
        }
    ]


def certificate_credential(pki: Pki, server: Server, name: str, identity: str) -> Path:
    """A credential file for a certificate-only client: no secret, a client certificate."""
    cert, key = pki.client(name, identity)
    path = pki.root / f"{name}.json"
    path.write_bytes(
        orjson.dumps(
            {
                "url": server.url,
                "client_id": name,
                "authentication": "certificate",
                "ca_file": "ca.crt",  # relative to the credential's directory
                "cert_file": cert.name,
                "key_file": key.name,
            }
        )
    )
    return path


def test_light_client_authenticates_by_certificate_alone(mtls_server: Server, pki: Pki) -> None:
    from cryptd_client import CryptdClient, ForbiddenError, UnauthenticatedError

    credential = certificate_credential(pki, mtls_server, "app", "spiffe://test.example/app")
    with CryptdClient.from_file(credential) as client:
        assert client.authentication == "certificate"
        token = client.encrypt("aes256-gcm", b"no secret needed", aad=b"a").ciphertext
        assert client.decrypt("aes256-gcm", token, aad=b"a").plaintext == b"no secret needed"
        # The policy of the client its certificate names applies.
        with pytest.raises(ForbiddenError):
            client.sign("ed25519", b"m")
        with pytest.raises(ForbiddenError):
            client.rotate_key("aes256-gcm")  # key management: admin clients only
    # The same unsigned requests over a certificate that names no certificate-only client.
    stranger = certificate_credential(pki, mtls_server, "stranger", "spiffe://test.example/x9")
    with CryptdClient.from_file(stranger) as client, pytest.raises(UnauthenticatedError):
        client.encrypt("aes256-gcm", b"x")


async def test_async_light_client_authenticates_by_certificate_alone(
    mtls_server: Server, pki: Pki
) -> None:
    from cryptd_client import AsyncCryptdClient

    credential = certificate_credential(pki, mtls_server, "app-async", "spiffe://test.example/app")
    async with AsyncCryptdClient.from_file(credential) as client:
        token = (await client.encrypt("aes256-gcm", b"async")).ciphertext
        assert (await client.decrypt("aes256-gcm", token)).plaintext == b"async"


def test_cryptd_call_with_a_certificate_only_credential(mtls_server: Server, pki: Pki) -> None:
    credential = certificate_credential(pki, mtls_server, "app-cli", "spiffe://test.example/app")
    encrypted = cryptd("call", "encrypt", "aes256-gcm", "--credential", str(credential),
                       "--data", "from the command line")  # fmt: skip
    assert encrypted.returncode == 0, encrypted.stderr
    token = orjson.loads(encrypted.stdout)["ciphertext"]
    decrypted = cryptd("call", "decrypt", "aes256-gcm", "--credential", str(credential),
                       "--data", token, "--raw")  # fmt: skip
    assert decrypted.returncode == 0, decrypted.stderr
    assert decrypted.stdout == "from the command line"
    refused = cryptd("call", "encrypt", "sm4-gcm", "--credential", str(credential), "--data", "x")
    assert refused.returncode == 1
    assert orjson.loads(refused.stderr)["error"]["code"] == "forbidden"


def test_a_client_without_a_secret_needs_a_certificate(pki: Pki, tmp_path: Path) -> None:
    from cryptd_client import CryptdClient

    cert, key = pki.client("plain", "spiffe://test.example/plain")
    with pytest.raises(ValueError, match="cert_file"):
        CryptdClient("https://127.0.0.1:1", "x", None)
    with pytest.raises(ValueError, match="https"):
        CryptdClient("http://127.0.0.1:1", "x", None, cert_file=cert, key_file=key)
    for document, message in (
        ({"url": "https://h", "client_id": "x"}, "no secret"),
        ({"url": "https://h", "client_id": "x", "authentication": "certificate",
          "secret": "AAAA", "cert_file": str(cert)}, "has no secret"),
        ({"url": "https://h", "client_id": "x", "authentication": "both"}, "authentication"),
    ):  # fmt: skip
        path = tmp_path / "credential.json"
        path.write_bytes(orjson.dumps(document))
        with pytest.raises(ValueError, match=message):
            CryptdClient.from_file(path)
