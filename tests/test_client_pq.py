"""The Python client and ``cryptd call`` on post-quantum keys, against a real server: KEM
encapsulation and decapsulation (checked against kyber-py), ML-DSA signing with a FIPS 204
context and an external mu (checked against dilithium-py), and data keys and rewrap to and
from an X-Wing key."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from dilithium_py.ml_dsa import ML_DSA_65
from kyber_py.ml_kem import ML_KEM_768

from cryptd_client import (
    AsyncCryptdClient,
    CryptdClient,
    DecryptionFailedError,
    Encapsulation,
    InvalidRequestError,
    SharedSecret,
)
from cryptd_client._crypto_endpoints import CryptoEndpoints
from service.cli import main
from tests.conftest import Server
from tests.migrate_support import client, credential
from tests.test_byok import import_key, ok
from tests.test_pq_api import mldsa_public, versions

pytestmark = pytest.mark.slow  # a live server

XWING_CIPHERTEXT = 1120  # draft-connolly-cfrg-xwing-kem: ML-KEM-768's 1,088 + X25519's 32


@pytest.fixture
def cryptd(server: Server) -> Iterator[CryptdClient]:
    with client(server) as c:
        yield c


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_decapsulate_opens_kyber_py_encapsulations_and_rejects_bad_lengths(
    server: Server, cryptd: CryptdClient
) -> None:
    seed = os.urandom(64)
    name = _name("cpq-kem")
    ok(import_key(server, name, "ml-kem-768", seed), 201)
    public = bytes.fromhex(versions(server, name)[0]["public_key_raw"])
    secret, ciphertext = ML_KEM_768.encaps(public)
    opened = cryptd.decapsulate(name, ciphertext)
    assert opened == SharedSecret(secret, 1)
    assert repr(opened) == "SharedSecret(key_version=1)"  # the secret is never printed
    made = cryptd.encapsulate(name)
    _, dk = ML_KEM_768.key_derive(seed)
    assert ML_KEM_768.decaps(dk, made.ciphertext) == made.shared_secret
    # A flipped bit: implicit rejection, another secret and no error (FIPS 203).
    flipped = bytes([made.ciphertext[0] ^ 1]) + made.ciphertext[1:]
    assert cryptd.decapsulate(name, flipped).shared_secret != made.shared_secret
    for bad in (ciphertext[:-1], ciphertext + b"\0"):
        with pytest.raises(InvalidRequestError, match="1088 bytes"):
            cryptd.decapsulate(name, bad)
    with pytest.raises(TypeError, match="bytes"):
        cryptd.decapsulate(name, base64.b64encode(ciphertext).decode())  # type: ignore[arg-type]


def test_xwing_encapsulation_batches_and_async(server: Server, cryptd: CryptdClient) -> None:
    name = _name("cpq-xwing")
    cryptd.create_key(name, "x25519-ml-kem-768")
    made = cryptd.encapsulate_batch(name, 3)
    assert all(isinstance(m, Encapsulation) for m in made)
    kems = [m for m in made if isinstance(m, Encapsulation)]
    assert [len(m.ciphertext) for m in kems] == [XWING_CIPHERTEXT] * 3
    assert len({m.shared_secret for m in kems}) == 3
    items: list[Any] = [kems[0].ciphertext, {"ciphertext": kems[1].ciphertext, "key_version": 1}]
    items.append(kems[2].ciphertext[:-1])
    opened = cryptd.decapsulate_batch(name, items)
    assert opened[:2] == [
        SharedSecret(kems[0].shared_secret, 1),
        SharedSecret(kems[1].shared_secret, 1),
    ]
    assert isinstance(opened[2], InvalidRequestError)

    async def round_trip() -> bool:
        async with AsyncCryptdClient.from_file(credential(server)) as acryptd:
            kem = await acryptd.encapsulate(name)
            secret = await acryptd.decapsulate(name, kem.ciphertext)
            return secret.shared_secret == kem.shared_secret

    assert asyncio.run(round_trip())
    with pytest.raises(InvalidRequestError):
        cryptd.encapsulate("aes256-gcm")  # the development key of that type: no KEM


def test_mldsa_context_and_external_mu_through_the_client(
    server: Server, cryptd: CryptdClient
) -> None:
    name = _name("cpq-dsa")
    cryptd.create_key(name, "ml-dsa-65")
    public = mldsa_public(server, name)
    signed = cryptd.sign(name, b"invoice 7", context=b"billing:v1")
    assert ML_DSA_65.verify(public, b"invoice 7", signed.signature, ctx=b"billing:v1")
    assert not ML_DSA_65.verify(public, b"invoice 7", signed.signature, ctx=b"billing:v2")
    assert cryptd.verify(name, b"invoice 7", signature=signed.signature, context=b"billing:v1")
    assert not cryptd.verify(name, b"invoice 7", signature=signed.signature)  # other context
    tampered = bytes([signed.signature[0] ^ 1]) + signed.signature[1:]
    assert not cryptd.verify(name, b"invoice 7", signature=tampered, context=b"billing:v1")
    # External mu (FIPS 204 6.2): the caller hashes the message, the service signs mu alone.
    mu = ML_DSA_65.prehash_external_mu(public, b"invoice 8", ctx=b"billing:v1")
    by_mu = cryptd.sign(name, mu, message_type="external_mu")
    assert ML_DSA_65.verify(public, b"invoice 8", by_mu.signature, ctx=b"billing:v1")
    assert cryptd.verify(name, mu, signature=by_mu.signature, message_type="external_mu")
    assert cryptd.verify(
        name, b"invoice 8", signature=by_mu.signature, context=b"billing:v1", message_type="raw"
    )
    with pytest.raises(InvalidRequestError):
        cryptd.sign(name, mu[:-1], message_type="external_mu")


def test_datakey_and_rewrap_between_rsa_oaep_and_xwing(cryptd: CryptdClient) -> None:
    rsa, xwing = _name("cpq-rsa"), _name("cpq-xwing")
    cryptd.create_key(rsa, "rsa-2048")
    cryptd.create_key(xwing, "x25519-ml-kem-768")
    dek = cryptd.datakey(rsa, bits=256, aad=b"tenant-1")
    moved = cryptd.rewrap(rsa, dek.ciphertext, aad=b"tenant-1", to_key=xwing)
    assert cryptd.decrypt(xwing, moved.ciphertext, aad=b"tenant-1").plaintext == dek.plaintext
    with pytest.raises(DecryptionFailedError):
        cryptd.decrypt(xwing, moved.ciphertext, aad=b"tenant-2")
    back = cryptd.rewrap(xwing, moved.ciphertext, aad=b"tenant-1", to_key=rsa)
    assert cryptd.decrypt(rsa, back.ciphertext, aad=b"tenant-1").plaintext == dek.plaintext
    fresh = cryptd.datakey(xwing, bits=128)
    assert len(fresh.plaintext) == 16
    assert cryptd.decrypt(xwing, fresh.ciphertext).plaintext == fresh.plaintext
    wrapped = cryptd.datakey_wrapped(xwing)
    assert len(cryptd.decrypt(xwing, wrapped.ciphertext).plaintext) == 32


def test_cli_encapsulate_and_decapsulate(
    server: Server, cryptd: CryptdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    name = _name("cpq-cli")
    cryptd.create_key(name, "x25519-ml-kem-768")
    cred = ["--credential", str(credential(server))]

    def call(*args: str) -> tuple[int, Any, str]:
        status = main(["call", *args, *cred])
        out, err = capsys.readouterr()
        return status, json.loads(out) if out.strip() else None, err

    status, made, _ = call("encapsulate", name)
    assert status == 0
    assert made["key_version"] == 1
    assert len(base64.b64decode(made["ciphertext"])) == XWING_CIPHERTEXT
    status, opened, _ = call("decapsulate", name, "--ciphertext", made["ciphertext"])
    assert (status, opened["shared_secret"]) == (0, made["shared_secret"])
    short = base64.b64encode(base64.b64decode(made["ciphertext"])[:-1]).decode()
    status, _, err = call("decapsulate", name, "--ciphertext", short)
    assert status == 1
    assert json.loads(err)["error"]["code"] == "invalid_request"
    with pytest.raises(SystemExit):
        main(["call", "encapsulate", name, "--data", "x", *cred])
    assert "does not take --data" in capsys.readouterr().err


def test_batches_of_xwing_tokens_are_cut_under_the_body_limit(cryptd: CryptdClient) -> None:
    """A thousand X-Wing tokens (about 1.6 KB each) would pass the service's 1 MiB body limit
    in one request: the client cuts batches by size as well as by count."""
    name = _name("cpq-big")
    cryptd.create_key(name, "x25519-ml-kem-768")
    plaintexts = [os.urandom(32) for _ in range(1000)]
    made = cryptd.encrypt_batch(name, [{"plaintext": p, "aad": b"t"} for p in plaintexts])
    tokens = [m.ciphertext for m in made if not isinstance(m, Exception)]
    assert len(tokens) == 1000
    items = [{"ciphertext": t, "aad": b"t"} for t in tokens]
    plan = vars(CryptoEndpoints)["decrypt_batch"].build(cryptd, name, items)
    first = next(plan)
    assert 0 < len(first.payload["batch"]) < 1000
    assert len(json.dumps(first.payload)) < 1024 * 1024
    opened = cryptd.decrypt_batch(name, items)
    assert [getattr(o, "plaintext", None) for o in opened] == plaintexts
    rewrapped = cryptd.rewrap_batch(name, items)
    assert all(not isinstance(r, Exception) for r in rewrapped)
