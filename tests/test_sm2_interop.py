"""SM2 interoperability in both directions with implementations written elsewhere: the OpenSSL 3
command line (``openssl pkeyutl``, ``openssl dgst -sm3`` with and without ``distid``) and the
pure-Python ``gmssl`` package (reference only: C1C2C3 by default, no 0x04 prefix, hex r||s)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from service.crypto import _sm2_codec as codec
from service.crypto.base import SignOptions
from service.crypto.sm2 import (
    DEFAULT_SIGNER_ID,
    Sm2Key,
    generate,
    import_key,
    load,
    message_digest,
)

DEFAULT = SignOptions()
RAW = SignOptions(encoding="raw")
EMPTY_ID = SignOptions(signer_id=b"")
DISTID = "distid:1234567812345678"
PAYLOADS = [b"k", b"encryption standard", bytes(range(256)) * 4]


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (required in CI)")
    pytest.skip(reason)


# --- the OpenSSL command line -------------------------------------------------------------------

Run = Callable[..., bytes]


@pytest.fixture(scope="module")
def openssl() -> Run:
    binary = shutil.which("openssl")
    if binary is None:
        _missing("the openssl command line is not installed")
    assert binary is not None
    algorithms_ = subprocess.run(
        [binary, "list", "-public-key-algorithms"], capture_output=True, check=True
    ).stdout
    if b"SM2" not in algorithms_:
        _missing("this openssl has no SM2")

    def run(*args: str | Path, data: bytes | None = None, check: bool = True) -> bytes:
        done = subprocess.run(
            [binary, *map(str, args)], input=data, capture_output=True, check=False, timeout=30
        )
        if check and done.returncode != 0:
            raise AssertionError(f"openssl {args[0]} failed: {done.stderr.decode()}")
        return done.stdout if check else done.stdout + done.stderr

    return run


@pytest.fixture(scope="module")
def openssl_key(openssl: Run, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Sm2Key]:
    """An SM2 key made by OpenSSL, imported into cryptd; and its PEM for the command line."""
    path = tmp_path_factory.mktemp("sm2") / "key.pem"
    openssl("genpkey", "-algorithm", "SM2", "-out", path)
    return path, load(import_key(path.read_bytes()))


@pytest.fixture
def public_pem(openssl_key: tuple[Path, Sm2Key], tmp_path: Path) -> Path:
    path = tmp_path / "pub.pem"
    path.write_text(openssl_key[1].public_key_pem())
    return path


def test_exported_public_key_is_an_sm2_key_to_openssl(
    openssl: Run, openssl_key: tuple[Path, Sm2Key], public_pem: Path
) -> None:
    text = openssl("pkey", "-pubin", "-in", public_pem, "-text", "-noout").decode()
    assert "ASN1 OID: SM2" in text
    printed = re.search(r"pub:\n((?:\s+[0-9a-f:]+\n)+)", text)
    assert printed is not None
    assert re.sub(r"[\s:]", "", printed.group(1)) == openssl_key[1].public_key_raw()
    # and it is byte for byte what OpenSSL itself exports for the key
    theirs = openssl("pkey", "-in", openssl_key[0], "-pubout")
    assert theirs.decode() == openssl_key[1].public_key_pem()


def test_openssl_sec1_export_imports(
    openssl: Run, openssl_key: tuple[Path, Sm2Key], tmp_path: Path
) -> None:
    sec1 = tmp_path / "sec1.pem"
    openssl("ec", "-in", openssl_key[0], "-out", sec1)
    assert load(import_key(sec1.read_bytes())).public_key_raw() == openssl_key[1].public_key_raw()
    generated = tmp_path / "ecparam.pem"  # a parameters block, then the key
    openssl("ecparam", "-genkey", "-name", "SM2", "-out", generated)
    key = load(import_key(generated.read_bytes()))
    assert key.public_key_raw().startswith("04")


@pytest.mark.parametrize("plaintext", PAYLOADS, ids=len)
def test_openssl_encrypts_cryptd_decrypts(
    openssl: Run, openssl_key: tuple[Path, Sm2Key], public_pem: Path, plaintext: bytes
) -> None:
    der = openssl("pkeyutl", "-encrypt", "-pubin", "-inkey", public_pem, data=plaintext)
    key = openssl_key[1]
    assert key.decrypt_external(der, "sm2") == plaintext
    reading = codec.parse_der(der)
    assert reading is not None
    assert key.decrypt_external(reading.to_c1c3c2(prefix=False), "sm2") == plaintext
    assert key.decrypt_external(reading.to_c1c2c3(prefix=False), "sm2-c1c2c3") == plaintext


@pytest.mark.parametrize("plaintext", PAYLOADS, ids=len)
def test_cryptd_encrypts_openssl_decrypts(
    openssl: Run, openssl_key: tuple[Path, Sm2Key], plaintext: bytes
) -> None:
    path, key = openssl_key
    reading = codec.parse_c1c3c2(key.encrypt_raw(plaintext), prefix=True)
    assert reading is not None
    assert openssl("pkeyutl", "-decrypt", "-inkey", path, data=reading.to_der()) == plaintext


def test_the_hybrid_tokens_data_key_is_plain_sm2(
    openssl: Run, openssl_key: tuple[Path, Sm2Key]
) -> None:
    path, key = openssl_key
    body = key.encrypt(b"migrated from RSA", b"aad")
    end = 2 + int.from_bytes(body[:2], "big")
    reading = codec.parse_c1c3c2(body[2:end], prefix=True)
    assert reading is not None
    dek = openssl("pkeyutl", "-decrypt", "-inkey", path, data=reading.to_der())
    assert len(dek) == 16
    nonce, sealed = body[end : end + 12], body[end + 12 :]
    decryptor = Cipher(algorithms.SM4(dek), modes.GCM(nonce, sealed[-16:])).decryptor()
    decryptor.authenticate_additional_data(b"aad")
    assert decryptor.update(sealed[:-16]) + decryptor.finalize() == b"migrated from RSA"


def test_openssl_signatures_with_distid_use_the_default_id(
    openssl: Run, openssl_key: tuple[Path, Sm2Key]
) -> None:
    path, key = openssl_key
    message = b"signed by openssl"
    signature = openssl("dgst", "-sm3", "-sign", path, "-sigopt", DISTID, data=message)
    assert key.verify(signature, message, prehashed=False, options=DEFAULT)
    assert not key.verify(signature, message, prehashed=False, options=EMPTY_ID)
    raw = codec.signature_to_raw(signature)
    assert raw is not None
    assert key.verify(raw, message, prehashed=False, options=RAW)


def test_openssl_signatures_without_distid_use_the_empty_id(
    openssl: Run, openssl_key: tuple[Path, Sm2Key]
) -> None:
    path, key = openssl_key
    message = b"signed by openssl without distid"
    signature = openssl("dgst", "-sm3", "-sign", path, data=message)
    assert key.verify(signature, message, prehashed=False, options=EMPTY_ID)
    assert not key.verify(signature, message, prehashed=False, options=DEFAULT)


def test_openssl_signatures_with_a_custom_id(
    openssl: Run, openssl_key: tuple[Path, Sm2Key]
) -> None:
    path, key = openssl_key
    message = b"custom id"
    signature = openssl(
        "dgst", "-sm3", "-sign", path, "-sigopt", "distid:ALICE123@YAHOO.COM", data=message
    )
    alice = SignOptions(signer_id=b"ALICE123@YAHOO.COM")
    assert key.verify(signature, message, prehashed=False, options=alice)
    assert not key.verify(signature, message, prehashed=False, options=DEFAULT)


def _openssl_verifies(
    openssl: Run, public_pem: Path, signature: bytes, message: bytes, tmp_path: Path, *opts: str
) -> bool:
    sig = tmp_path / "sig.der"
    sig.write_bytes(signature)
    out = openssl(
        "dgst", "-sm3", "-verify", public_pem, *opts, "-signature", sig, data=message, check=False
    )
    return b"Verified OK" in out


def test_cryptd_signatures_verify_in_openssl(
    openssl: Run, openssl_key: tuple[Path, Sm2Key], public_pem: Path, tmp_path: Path
) -> None:
    key = openssl_key[1]
    message = b"signed by cryptd"
    default = key.sign(message, prehashed=False, options=DEFAULT)
    assert _openssl_verifies(openssl, public_pem, default, message, tmp_path, "-sigopt", DISTID)
    assert not _openssl_verifies(openssl, public_pem, default, message, tmp_path)
    empty = key.sign(message, prehashed=False, options=EMPTY_ID)
    assert _openssl_verifies(openssl, public_pem, empty, message, tmp_path)
    alice = key.sign(message, prehashed=False, options=SignOptions(signer_id=b"ALICE123@YAHOO.COM"))
    opts = ("-sigopt", "distid:ALICE123@YAHOO.COM")
    assert _openssl_verifies(openssl, public_pem, alice, message, tmp_path, *opts)
    assert not _openssl_verifies(openssl, public_pem, alice, b"other", tmp_path, *opts)


# --- gmssl (pure Python) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gmssl_sm2() -> Any:
    try:
        from gmssl import sm2
    except ImportError:
        _missing("gmssl (test extra) is not installed")
    return sm2


def _gmssl(sm2: Any, key: Sm2Key, material: bytes, mode: int) -> Any:
    """A gmssl CryptSM2 for ``key``. The public key is set after construction: the
    constructor's ``lstrip("04")`` corrupts keys whose x starts with a 0 or 4 digit."""
    crypt = sm2.CryptSM2(private_key=material.hex(), public_key="", mode=mode)
    crypt.public_key = key.public_point[1:].hex()
    return crypt


def _gmssl_encrypt(crypt: Any, plaintext: bytes) -> bytes:
    """gmssl's encryption, done again with a new k when it returns None: it does so when the
    KDF output is all zero (1 in 256 for a one-byte message), where GM/T 0003.4 says to pick
    another k."""
    for _ in range(64):
        ciphertext = crypt.encrypt(plaintext)
        if ciphertext is not None:
            assert isinstance(ciphertext, bytes)
            return ciphertext
    raise AssertionError("gmssl found no usable k in 64 tries")


@pytest.fixture(scope="module", params=range(3))
def gmssl_pair(request: pytest.FixtureRequest) -> tuple[Sm2Key, bytes]:
    material = generate()
    return load(material), material


@pytest.mark.parametrize("plaintext", PAYLOADS[:2], ids=len)
def test_gmssl_encrypts_cryptd_decrypts(
    gmssl_sm2: Any, gmssl_pair: tuple[Sm2Key, bytes], plaintext: bytes
) -> None:
    key, material = gmssl_pair
    c1c2c3 = _gmssl_encrypt(_gmssl(gmssl_sm2, key, material, mode=0), plaintext)  # its default
    assert key.decrypt_external(c1c2c3, "sm2-c1c2c3") == plaintext
    c1c3c2 = _gmssl_encrypt(_gmssl(gmssl_sm2, key, material, mode=1), plaintext)
    assert key.decrypt_external(c1c3c2, "sm2") == plaintext


@pytest.mark.parametrize("plaintext", PAYLOADS[:2], ids=len)
def test_cryptd_encrypts_gmssl_decrypts(
    gmssl_sm2: Any, gmssl_pair: tuple[Sm2Key, bytes], plaintext: bytes
) -> None:
    key, material = gmssl_pair
    reading = codec.parse_c1c3c2(key.encrypt_raw(plaintext), prefix=True)
    assert reading is not None
    mode1 = _gmssl(gmssl_sm2, key, material, mode=1)
    assert mode1.decrypt(reading.to_c1c3c2(prefix=False)) == plaintext
    mode0 = _gmssl(gmssl_sm2, key, material, mode=0)
    assert mode0.decrypt(reading.to_c1c2c3(prefix=False)) == plaintext


def test_gmssl_signatures_verify_in_cryptd(
    gmssl_sm2: Any, gmssl_pair: tuple[Sm2Key, bytes]
) -> None:
    key, material = gmssl_pair
    message = b"signed by gmssl"
    crypt = _gmssl(gmssl_sm2, key, material, mode=1)
    signature = bytes.fromhex(crypt.sign_with_sm3(message, secrets.token_hex(32)))
    assert key.verify(signature, message, prehashed=False, options=RAW)
    assert not key.verify(
        signature, message, prehashed=False, options=SignOptions(encoding="raw", signer_id=b"")
    )


def test_cryptd_signatures_verify_in_gmssl(
    gmssl_sm2: Any, gmssl_pair: tuple[Sm2Key, bytes]
) -> None:
    key, material = gmssl_pair
    message = b"signed by cryptd"
    signature = key.sign(message, prehashed=False, options=RAW)
    crypt = _gmssl(gmssl_sm2, key, material, mode=1)
    assert crypt.verify_with_sm3(signature.hex(), message)
    assert not crypt.verify_with_sm3(signature.hex(), message + b"!")


def test_custom_signer_id_with_gmssl(gmssl_sm2: Any, gmssl_pair: tuple[Sm2Key, bytes]) -> None:
    """gmssl hard-codes the default ID in sign_with_sm3; its raw sign() over our e covers others."""
    key, material = gmssl_pair
    crypt = _gmssl(gmssl_sm2, key, material, mode=1)
    options = SignOptions(encoding="raw", signer_id=b"ALICE123@YAHOO.COM")
    e = message_digest(key.public_point, b"m", b"ALICE123@YAHOO.COM")
    signature = bytes.fromhex(crypt.sign(e, secrets.token_hex(32)))
    assert key.verify(signature, b"m", prehashed=False, options=options)
    ours = key.sign(b"m", prehashed=False, options=options)
    assert crypt.verify(ours.hex(), e)
    assert not crypt.verify(ours.hex(), message_digest(key.public_point, b"m", DEFAULT_SIGNER_ID))
