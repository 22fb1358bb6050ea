"""A client generated from the served /openapi.json by an off-the-shelf generator
(openapi-python-client) makes a signed encrypt / decrypt round trip with typed responses. The
signature is added through the generator's documented hook: httpx event hooks passed in
``httpx_args``, which see each request's final path and body bytes."""

from __future__ import annotations

import base64
import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from cryptd_client import sign_request
from tests.conftest import Server

pytestmark = pytest.mark.slow
PACKAGE = "cryptd_generated"


@pytest.fixture(scope="module")
def generated(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    executable = shutil.which("openapi-python-client", path=str(Path(sys.executable).parent))
    assert executable is not None, "openapi-python-client is part of the test extra"
    where = tmp_path_factory.mktemp("generated")
    subprocess.run(
        [
            executable,
            "generate",
            "--url",
            f"{server.url}/openapi.json",
            "--meta",
            "none",
            "--output-path",
            str(where / PACKAGE),
            "--fail-on-warning",  # every schema of the document generates
        ],
        check=True,
        cwd=where,
        capture_output=True,
        timeout=300,
    )
    sys.path.insert(0, str(where))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(where))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _signed_client(generated: ModuleType, server: Server) -> object:
    def sign(request: httpx.Request) -> None:
        path, _, query = request.url.raw_path.decode("ascii").partition("?")
        request.headers.update(
            sign_request(
                request.method, path, query, request.content, server.client_id, server.secret
            )
        )

    # The document's security schemes are header schemes, so the generator's client is an
    # AuthenticatedClient; its token header is the Signature, which the hook computes.
    return generated.AuthenticatedClient(
        base_url=server.url,
        token="unsigned",
        prefix="",
        auth_header_name="Signature",
        raise_on_unexpected_status=True,  # a status the document does not declare fails
        httpx_args={"event_hooks": {"request": [sign]}},
    )


def test_generated_client_round_trip(generated: ModuleType, server: Server) -> None:
    encrypt = importlib.import_module(f"{PACKAGE}.api.crypto.encrypt")
    decrypt = importlib.import_module(f"{PACKAGE}.api.crypto.decrypt")
    models = importlib.import_module(f"{PACKAGE}.models")
    with _signed_client(generated, server) as client:  # type: ignore[attr-defined]
        _round_trip(client, encrypt, decrypt, models)


def _round_trip(
    client: object, encrypt: ModuleType, decrypt: ModuleType, models: ModuleType
) -> None:
    plaintext = b"generated from /openapi.json"

    sealed = encrypt.sync(
        "aes256-gcm",
        client=client,
        body=models.EncryptRequest(
            plaintext=base64.b64encode(plaintext).decode(), aad=base64.b64encode(b"ctx").decode()
        ),
    )
    assert isinstance(sealed, models.EncryptResponse), sealed
    assert sealed.ciphertext.startswith("cryptd:v")
    assert isinstance(sealed.key_version, int)

    opened = decrypt.sync(
        "aes256-gcm",
        client=client,
        body=models.DecryptRequest(
            ciphertext=sealed.ciphertext, aad=base64.b64encode(b"ctx").decode()
        ),
    )
    assert isinstance(opened, models.DecryptResponse), opened
    assert base64.b64decode(opened.plaintext) == plaintext
    assert opened.key_version == sealed.key_version

    # Errors are typed too: the wrong aad is decryption_failed, in the one error shape.
    refused = decrypt.sync_detailed(
        "aes256-gcm",
        client=client,
        body=models.DecryptRequest(ciphertext=sealed.ciphertext),
    )
    assert refused.status_code == 400
    assert isinstance(refused.parsed, models.Error)
    assert refused.parsed.error.code == models.ErrorDetailCode.DECRYPTION_FAILED


def test_generated_batch_form_is_typed(generated: ModuleType, server: Server) -> None:
    encrypt = importlib.import_module(f"{PACKAGE}.api.crypto.encrypt")
    models = importlib.import_module(f"{PACKAGE}.models")
    with _signed_client(generated, server) as client:  # type: ignore[attr-defined]
        answer = encrypt.sync(
            "aes256-gcm",
            client=client,
            body=models.EncryptRequestBatch(
                batch=[
                    models.EncryptRequest(plaintext="YQ=="),
                    models.EncryptRequest(plaintext="!"),
                ]
            ),
        )
    assert isinstance(answer, models.EncryptResponseBatch), answer
    first, second = answer.batch
    assert isinstance(first, models.EncryptResponse)
    assert isinstance(second, models.Error)
    assert second.error.code == models.ErrorDetailCode.INVALID_REQUEST


def test_unsigned_requests_are_refused(generated: ModuleType, server: Server) -> None:
    list_keys = importlib.import_module(f"{PACKAGE}.api.keys.list_keys")
    with generated.AuthenticatedClient(base_url=server.url, token="x") as unsigned:
        answer = list_keys.sync_detailed(client=unsigned)
    assert answer.status_code == 401
