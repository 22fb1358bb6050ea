"""Known-answer vectors for HMAC, HKDF and AES key wrap with padding, through cryptd's own code.

Sources (each JSON file under tests/vectors names its origin):
- HMAC-SHA-256 and HMAC-SHA-512: RFC 4231 section 4, test cases 1-7.
- HMAC-SM3: GM/T 0042-2015 Appendix D.3, examples 1-4 (also in OpenSSL's evpmac_sm3.txt).
- HKDF-SHA-256: RFC 5869 Appendix A, test cases 1-3.
- AES key wrap with padding: RFC 5649 section 6, both examples.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, keywrap, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from service.crypto import derived, wrapping
from service.crypto.base import InvalidKeyMaterial, KeyHandle, SignOptions, UnsupportedOperation
from service.crypto.registry import KEY_TYPES
from service.crypto.rsa import OAEP

VECTORS = Path(__file__).parent / "vectors"


def load(name: str) -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = json.loads((VECTORS / name).read_text())["tests"]
    return tests


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def flip(data: bytes, index: int) -> bytes:
    changed = bytearray(data)
    changed[index] ^= 0x01
    return bytes(changed)


def hmac_handle(type_name: str, key: bytes) -> KeyHandle:
    """The key type's handle over the vector's key (load: keys shorter than the import floor,
    such as RFC 4231's "Jefe", are still HMAC keys)."""
    return KEY_TYPES[type_name].load(key)


def check_tag(handle: KeyHandle, data: bytes, expected: bytes) -> None:
    tag = handle.mac(data)
    assert tag[: len(expected)] == expected
    if len(expected) == len(tag):
        assert handle.verify_mac(expected, data) is True
    else:
        # A truncated tag is not the MAC: cryptd compares whole tags.
        assert handle.verify_mac(expected, data) is False
    for index in (0, len(tag) // 2, len(tag) - 1):
        assert handle.verify_mac(flip(tag, index), data) is False
    for bad in (b"", tag[:-1], tag + b"\x00", bytes(len(tag))):
        assert handle.verify_mac(bad, data) is False
    assert handle.verify_mac(tag, data + b"\x00") is False
    if data:
        assert handle.verify_mac(tag, flip(data, 0)) is False


RFC4231 = load("rfc4231_hmac_sha2.json")


@pytest.mark.parametrize("type_name", ["hmac-sha256", "hmac-sha512"])
@pytest.mark.parametrize("vector", RFC4231, ids=[f"case{v['case']}" for v in RFC4231])
def test_rfc4231(type_name: str, vector: dict[str, Any]) -> None:
    check_tag(hmac_handle(type_name, h(vector["key"])), h(vector["data"]), h(vector[type_name]))


GMT0042 = load("hmac_sm3_gmt0042.json")


@pytest.mark.parametrize("vector", GMT0042, ids=[f"example{v['case']}" for v in GMT0042])
def test_gmt0042_hmac_sm3(vector: dict[str, Any]) -> None:
    check_tag(hmac_handle("hmac-sm3", h(vector["key"])), h(vector["data"]), h(vector["mac"]))


@pytest.mark.parametrize("type_name", ["hmac-sha256", "hmac-sha512", "hmac-sm3"])
def test_hmac_key_generation_and_import_limits(type_name: str) -> None:
    key_type = KEY_TYPES[type_name]
    size = {"hmac-sha256": 32, "hmac-sha512": 64, "hmac-sm3": 32}[type_name]
    first, second = key_type.generate(), key_type.generate()
    assert len(first) == size
    assert first != second
    assert key_type.supports("hmac")
    assert key_type.supports("verify")
    assert not key_type.supports("sign")
    assert not key_type.supports("encrypt")
    import_key = key_type.import_key
    assert import_key is not None
    for size_ok in (16, 32, 64, 1024):
        assert import_key(b"k" * size_ok) == b"k" * size_ok
    for too_short_or_long in (0, 4, 15, 1025):
        with pytest.raises(InvalidKeyMaterial, match="16 to 1024 bytes"):
            import_key(b"k" * too_short_or_long)
    # Two keys, two MACs.
    assert key_type.load(first).mac(b"m") != key_type.load(second).mac(b"m")


def test_hmac_handles_are_not_signers() -> None:
    handle = hmac_handle("hmac-sha256", bytes(32))
    with pytest.raises(UnsupportedOperation, match="does not support"):
        handle.sign(b"m", prehashed=False, options=SignOptions())
    with pytest.raises(UnsupportedOperation, match="does not support"):
        handle.encrypt(b"m", b"")
    with pytest.raises(TypeError):
        pickle.dumps(handle)


HKDF = load("rfc5869_hkdf_sha256.json")


@pytest.mark.parametrize("vector", HKDF, ids=[f"case{v['case']}" for v in HKDF])
def test_rfc5869_hkdf_sha256(vector: dict[str, Any]) -> None:
    salt = h(vector["salt"]) or None  # case 3: no salt (HashLen zero bytes)
    okm = derived.hkdf(
        hashes.SHA256(),
        h(vector["ikm"]),
        salt=salt,
        info=h(vector["info"]),
        length=vector["length"],
    )
    assert okm == h(vector["okm"])
    assert len(okm) == vector["length"]
    # Another info or another ikm gives another key.
    assert (
        derived.hkdf(
            hashes.SHA256(), h(vector["ikm"]), salt=salt, info=b"x", length=vector["length"]
        )
        != okm
    )
    assert (
        derived.hkdf(
            hashes.SHA256(),
            flip(h(vector["ikm"]), 0),
            salt=salt,
            info=h(vector["info"]),
            length=vector["length"],
        )
        != okm
    )


KWP = load("rfc5649_aes_kwp.json")


@pytest.mark.parametrize("vector", KWP, ids=[f"example{v['case']}" for v in KWP])
def test_rfc5649_key_wrap_with_padding(vector: dict[str, Any]) -> None:
    kek, key, wrapped = h(vector["kek"]), h(vector["key"]), h(vector["wrap"])
    assert keywrap.aes_key_wrap_with_padding(kek, key) == wrapped
    assert keywrap.aes_key_unwrap_with_padding(kek, wrapped) == key
    for index in (0, len(wrapped) - 1):
        with pytest.raises(keywrap.InvalidUnwrap):
            keywrap.aes_key_unwrap_with_padding(kek, flip(wrapped, index))
    with pytest.raises(keywrap.InvalidUnwrap):
        keywrap.aes_key_unwrap_with_padding(flip(kek, 0), wrapped)


@pytest.fixture(scope="module")
def wrapping_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=wrapping.WRAPPING_KEY_BITS)


def unwrap(private: rsa.RSAPrivateKey, blob: bytes) -> bytes:
    """Through the wrapping key type's own handle, as the service unwraps."""
    handle = KEY_TYPES[wrapping.WRAPPING_KEY_TYPE].load(pkcs8(private))
    return wrapping.unwrap(lambda block: handle.decrypt_external(block, "rsa-oaep-sha256"), blob)


def pkcs8(private: rsa.RSAPrivateKey) -> bytes:
    return private.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def test_import_wrapping_round_trip_and_layout(wrapping_key: rsa.RSAPrivateKey) -> None:
    material = os.urandom(32)
    blob = wrapping.wrap(wrapping_key.public_key(), material)
    # 512-byte RSA-OAEP block, then RFC 5649 of 32 bytes (32 + 8).
    assert len(blob) == 512 + 40
    assert unwrap(wrapping_key, blob) == material
    for size in (1, 7, 8, 31, 33, 1200):
        assert unwrap(wrapping_key, wrapping.wrap(wrapping_key.public_key(), b"m" * size))


def test_import_unwrap_refuses_every_damage(wrapping_key: rsa.RSAPrivateKey) -> None:
    material = os.urandom(32)
    blob = wrapping.wrap(wrapping_key.public_key(), material)
    other = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    damaged = {
        "another wrapping key": (wrapping.wrap(other.public_key(), material), "does not decrypt"),
        "truncated": (blob[:-8], "does not unwrap"),
        "truncated to the RSA block": (blob[:520], "too short"),
        "cut mid-block": (blob[:-3], "multiple of 8"),
        "re-ordered": (blob[512:] + blob[:512], "does not decrypt"),
        "first block changed": (flip(blob, 100), "does not decrypt"),
        "wrap changed": (flip(blob, 530), "does not unwrap"),
        "empty": (b"", "too short"),
    }
    for bad, message in damaged.values():
        with pytest.raises(wrapping.WrappedKeyError, match=message):
            unwrap(wrapping_key, bad)
    # An ephemeral key of the wrong size.
    short = wrapping_key.public_key().encrypt(b"k" * 16, OAEP)
    with pytest.raises(wrapping.WrappedKeyError, match="256-bit"):
        unwrap(wrapping_key, short + keywrap.aes_key_wrap_with_padding(b"k" * 16, b"x" * 16))
