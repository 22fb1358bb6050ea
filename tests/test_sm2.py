"""SM2 key type: known answers from GB/T 32918.5, every ciphertext encoding, tampering in every
region, signature options and encodings, key import/export, and the libcrypto binding's hygiene."""

from __future__ import annotations

import base64
import json
import pickle
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from service.crypto import _libcrypto
from service.crypto import _sm2_codec as codec
from service.crypto.base import (
    InvalidCiphertext,
    InvalidKeyMaterial,
    InvalidOptions,
    SignOptions,
)
from service.crypto.sm2 import (
    DEFAULT_SIGNER_ID,
    SM2,
    Sm2Key,
    compute_z,
    generate,
    import_key,
    load,
    message_digest,
)
from service.crypto.sm3 import sm3

VECTORS = json.loads((Path(__file__).parent / "vectors" / "sm2_gbt32918_5.json").read_text())
SIG = VECTORS["signature"]
ENC = VECTORS["encryption"]
DEFAULT = SignOptions()
RAW = SignOptions(encoding="raw")
SPKI_PREFIX = bytes.fromhex("3059301306072a8648ce3d020106082a811ccf5501822d034200")


@pytest.fixture(scope="module")
def standard_key() -> Sm2Key:
    return load(bytes.fromhex(VECTORS["private_key"]))


@pytest.fixture(scope="module")
def key() -> Sm2Key:
    return load(generate())


@pytest.fixture(scope="module")
def other_key() -> Sm2Key:
    return load(generate())


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    changed = bytearray(data)
    changed[index] ^= mask
    return bytes(changed)


def standard_ciphertext() -> codec.Sm2Ciphertext:
    c1 = bytes.fromhex(ENC["c1"])
    return codec.Sm2Ciphertext(
        c1[1:33], c1[33:], bytes.fromhex(ENC["c3"]), bytes.fromhex(ENC["c2"])
    )


# --- known answers ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", VECTORS["sm3"], ids=lambda c: c["message_ascii"][:8])
def test_sm3_known_answers(case: dict[str, str]) -> None:
    assert sm3(case["message_ascii"].encode()).hex() == case["digest"]


def test_public_key_is_derived_from_the_standard_private_key(standard_key: Sm2Key) -> None:
    assert standard_key.public_key_raw() == VECTORS["public_key"]


def test_z_and_e_known_answers(standard_key: Sm2Key) -> None:
    signer_id = SIG["signer_id_ascii"].encode()
    assert signer_id == DEFAULT_SIGNER_ID
    point = bytes.fromhex(VECTORS["public_key"])
    assert compute_z(point, signer_id).hex() == SIG["z"]
    assert compute_z(point[1:], signer_id).hex() == SIG["z"]  # x || y accepted too
    for bad in (b"\x02" + point[1:], point[:-2], point + b"\x00"):
        with pytest.raises(ValueError, match="public point"):
            compute_z(bad, signer_id)
    assert message_digest(point, SIG["message_ascii"].encode()).hex() == SIG["e"]


def test_the_standards_signature_verifies(standard_key: Sm2Key) -> None:
    message = SIG["message_ascii"].encode()
    raw = bytes.fromhex(SIG["r"] + SIG["s"])
    der = codec.signature_to_der(raw)
    assert der is not None
    assert standard_key.verify(raw, message, prehashed=False, options=RAW)
    assert standard_key.verify(der, message, prehashed=False, options=DEFAULT)
    e = bytes.fromhex(SIG["e"])
    assert standard_key.verify(raw, e, prehashed=True, options=RAW)
    # ...and only under its own ID, message and value
    assert not standard_key.verify(
        raw, message, prehashed=False, options=SignOptions(encoding="raw", signer_id=b"")
    )
    assert not standard_key.verify(raw, message + b".", prehashed=False, options=RAW)
    assert not standard_key.verify(flip(raw, 63), message, prehashed=False, options=RAW)


def test_the_standards_ciphertext_has_the_published_der() -> None:
    reading = standard_ciphertext()
    assert reading.to_der().hex() == ENC["der"]
    assert codec.parse_der(bytes.fromhex(ENC["der"])) == reading


def test_the_standards_c1_x_starts_with_04() -> None:
    # which makes the prefix-less C1C3C2 of this example start with 0x04: the detection trap
    assert standard_ciphertext().x[0] == 0x04


@pytest.mark.parametrize(
    ("fmt", "encode"),
    [
        ("sm2", lambda c: c.to_c1c3c2(prefix=True)),
        ("sm2", lambda c: c.to_c1c3c2(prefix=False)),
        ("sm2", lambda c: c.to_der()),
        ("sm2-c1c2c3", lambda c: c.to_c1c2c3(prefix=True)),
        ("sm2-c1c2c3", lambda c: c.to_c1c2c3(prefix=False)),
    ],
    ids=["c1c3c2", "c1c3c2-no-04", "der", "c1c2c3", "c1c2c3-no-04"],
)
def test_the_standards_ciphertext_decrypts_in_every_encoding(
    standard_key: Sm2Key, fmt: str, encode: Any
) -> None:
    ciphertext = encode(standard_ciphertext())
    assert standard_key.decrypt_external(ciphertext, fmt) == ENC["message_ascii"].encode()


# --- encryption ---------------------------------------------------------------------------------


def test_hybrid_round_trip_and_layout(key: Sm2Key) -> None:
    body = key.encrypt(b"attack at dawn", b"context")
    assert key.decrypt(body, b"context") == b"attack at dawn"
    wrapped_len = int.from_bytes(body[:2], "big")
    assert wrapped_len == 1 + 64 + 32 + 16  # C1C3C2 with 0x04 of a 16-byte SM4 key
    assert body[2] == 0x04
    assert len(body) == 2 + wrapped_len + 12 + len(b"attack at dawn") + 16
    assert key.decrypt(key.encrypt(b"", b""), b"") == b""


def test_hybrid_refuses_wrong_aad_and_other_key(key: Sm2Key, other_key: Sm2Key) -> None:
    body = key.encrypt(b"payload", b"aad")
    with pytest.raises(InvalidCiphertext):
        key.decrypt(body, b"aaD")
    with pytest.raises(InvalidCiphertext):
        other_key.decrypt(body, b"aad")


def test_every_region_of_the_hybrid_body_is_authenticated(key: Sm2Key) -> None:
    body = key.encrypt(b"sixteen byte msg", b"aad")
    regions = {
        "length": [0, 1],
        "c1": [2, 3, 40, 66],
        "c3": [67, 80, 98],
        "wrapped dek": [99, 114],
        "nonce": [115, 126],
        "ciphertext": [127, 142],
        "tag": [143, len(body) - 1],
    }
    for offsets in regions.values():
        for offset in offsets:
            with pytest.raises(InvalidCiphertext):
                key.decrypt(flip(body, offset), b"aad")
    for size in range(len(body)):
        with pytest.raises(InvalidCiphertext):
            key.decrypt(body[:size], b"aad")
    with pytest.raises(InvalidCiphertext):
        key.decrypt(body + b"\x00", b"aad")


@pytest.mark.parametrize("size", [1, 16, 255, 256, 8192])
def test_raw_encryption_round_trips_in_every_encoding(key: Sm2Key, size: int) -> None:
    plaintext = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    ciphertext = key.encrypt_raw(plaintext)
    assert len(ciphertext) == 1 + 64 + 32 + size
    reading = codec.parse_c1c3c2(ciphertext, prefix=True)
    assert reading is not None
    for fmt, encoded in [
        ("sm2", ciphertext),
        ("sm2", ciphertext[1:]),
        ("sm2", reading.to_der()),
        ("sm2-c1c2c3", reading.to_c1c2c3(prefix=True)),
        ("sm2-c1c2c3", reading.to_c1c2c3(prefix=False)),
    ]:
        assert key.decrypt_external(encoded, fmt) == plaintext


def test_encryption_is_randomised(key: Sm2Key) -> None:
    assert key.encrypt_raw(b"same") != key.encrypt_raw(b"same")
    with pytest.raises(ValueError, match="empty"):
        key.encrypt_raw(b"")


def test_prefixless_c1_whose_x_starts_with_04_decrypts(key: Sm2Key) -> None:
    for _ in range(20_000):  # P(miss) = (255/256)^20000, about 1e-34
        ciphertext = key.encrypt_raw(b"x starts with 04")
        if ciphertext[1] == 0x04:
            break
    else:
        pytest.fail("no ciphertext with x starting with 0x04")
    reading = codec.parse_c1c3c2(ciphertext, prefix=True)
    assert reading is not None
    assert key.decrypt_external(ciphertext[1:], "sm2") == b"x starts with 04"
    assert key.decrypt_external(reading.to_c1c2c3(prefix=False), "sm2-c1c2c3") == (
        b"x starts with 04"
    )


@pytest.mark.parametrize(
    "offset",
    [0, 1, 32, 33, 64, 65, 96, 97, 100],
    ids=["prefix", "x-first", "x-last", "y-first", "y-last", "c3-first", "c3-last", "c2", "c2-end"],
)
def test_tampered_raw_ciphertext_is_refused(key: Sm2Key, offset: int) -> None:
    ciphertext = key.encrypt_raw(b"four")
    for mask in (0x01, 0x80):
        tampered = flip(ciphertext, offset, mask)
        with pytest.raises(InvalidCiphertext):
            key.decrypt_external(tampered, "sm2")
        if offset:
            with pytest.raises(InvalidCiphertext):
                key.decrypt_external(tampered[1:], "sm2")


def test_tampered_c1c2c3_is_refused(key: Sm2Key) -> None:
    reading = codec.parse_c1c3c2(key.encrypt_raw(b"legacy order"), prefix=True)
    assert reading is not None
    ciphertext = reading.to_c1c2c3()
    for offset in (1, 40, 65, 70, len(ciphertext) - 32, len(ciphertext) - 1):
        with pytest.raises(InvalidCiphertext):
            key.decrypt_external(flip(ciphertext, offset), "sm2-c1c2c3")
    # the wrong order is refused too: C3 decides
    with pytest.raises(InvalidCiphertext):
        key.decrypt_external(ciphertext, "sm2")
    with pytest.raises(InvalidCiphertext):
        key.decrypt_external(reading.to_c1c3c2(), "sm2-c1c2c3")


def test_tampered_der_is_refused(standard_key: Sm2Key) -> None:
    der = bytes.fromhex(ENC["der"])
    # SEQUENCE header, x INTEGER header and value, y (with its 00 pad), C3, C2, trailing bytes
    for offset in (0, 1, 2, 3, 4, 20, 36, 37, 38, 39, 60, 71, 72, 73, 90, 105, 106, 107, 125):
        with pytest.raises(InvalidCiphertext):
            standard_key.decrypt_external(flip(der, offset), "sm2")
    for suffix in (b"\x00", b"\x04"):
        with pytest.raises(InvalidCiphertext):
            standard_key.decrypt_external(der + suffix, "sm2")


def test_non_canonical_der_is_refused(standard_key: Sm2Key) -> None:
    reading = standard_ciphertext()
    x = codec.tlv(0x02, b"\x00" + reading.x)  # a needless 00 pad: not DER
    y = codec.der_integer(int.from_bytes(reading.y, "big"))
    body = x + y + codec.tlv(0x04, reading.c3) + codec.tlv(0x04, reading.c2)
    with pytest.raises(InvalidCiphertext):
        standard_key.decrypt_external(codec.tlv(0x30, body), "sm2")
    long_length = bytes([0x30, 0x81, len(reading.to_der()) - 2]) + reading.to_der()[2:]
    with pytest.raises(InvalidCiphertext):
        standard_key.decrypt_external(long_length, "sm2")


def test_invalid_points_are_refused(key: Sm2Key) -> None:
    c3, c2 = bytes(32), b"\x01" * 8
    off_curve = codec.Sm2Ciphertext((1).to_bytes(32, "big"), (1).to_bytes(32, "big"), c3, c2)
    infinity = codec.Sm2Ciphertext(bytes(32), bytes(32), c3, c2)
    for reading in (off_curve, infinity):
        for encoded in (reading.to_der(), reading.to_c1c3c2(), reading.to_c1c3c2(prefix=False)):
            with pytest.raises(InvalidCiphertext):
                key.decrypt_external(encoded, "sm2")
    beyond_p = codec.P.to_bytes(32, "big")
    assert codec.parse_c1c3c2(beyond_p + bytes(32) + c3 + c2, prefix=False) is None


def test_short_and_empty_inputs_are_refused(key: Sm2Key) -> None:
    ciphertext = key.encrypt_raw(b"abc")
    for size in range(len(ciphertext)):
        for fmt in ("sm2", "sm2-c1c2c3"):
            with pytest.raises(InvalidCiphertext):
                key.decrypt_external(ciphertext[:size], fmt)


def test_random_inputs_only_ever_raise_invalid_ciphertext(key: Sm2Key) -> None:
    generator = random.Random(32918)  # reproducible junk, not key material
    for _ in range(1500):
        size = generator.choice([0, 1, 2, 96, 97, 98, 113, 126, 127, 200])
        junk = bytearray(generator.randbytes(size))
        if junk and generator.random() < 0.5:
            junk[0] = generator.choice([0x04, 0x30])
        if len(junk) > 2 and junk[0] == 0x30 and generator.random() < 0.5:
            junk[1] = len(junk) - 2 if len(junk) < 130 else 0x81
        for fmt in ("sm2", "sm2-c1c2c3"):
            with pytest.raises(InvalidCiphertext):
                key.decrypt_external(bytes(junk), fmt)


def test_unknown_external_format_is_an_options_error(key: Sm2Key) -> None:
    with pytest.raises(InvalidOptions):
        key.decrypt_external(key.encrypt_raw(b"x"), "rsa-oaep-sha256")


# --- signatures ---------------------------------------------------------------------------------


def test_sign_verify_der_and_raw(key: Sm2Key) -> None:
    der = key.sign(b"message", prehashed=False, options=DEFAULT)
    assert der[0] == 0x30
    assert key.verify(der, b"message", prehashed=False, options=DEFAULT)
    raw = key.sign(b"message", prehashed=False, options=RAW)
    assert len(raw) == 64
    assert key.verify(raw, b"message", prehashed=False, options=RAW)
    assert key.verify(
        codec.signature_to_der(raw) or b"", b"message", prehashed=False, options=DEFAULT
    )
    assert codec.signature_to_raw(der) is not None
    assert key.verify(codec.signature_to_raw(der) or b"", b"message", prehashed=False, options=RAW)
    # the other encoding's bytes are not a signature
    assert not key.verify(raw, b"message", prehashed=False, options=DEFAULT)
    assert not key.verify(der, b"message", prehashed=False, options=RAW)


def test_signatures_are_randomised(key: Sm2Key) -> None:
    assert key.sign(b"m", prehashed=False, options=RAW) != key.sign(
        b"m", prehashed=False, options=RAW
    )


def test_signer_id_is_bound(key: Sm2Key) -> None:
    alice = SignOptions(signer_id=b"ALICE123@YAHOO.COM")
    empty = SignOptions(signer_id=b"")
    signature = key.sign(b"m", prehashed=False, options=alice)
    assert key.verify(signature, b"m", prehashed=False, options=alice)
    assert not key.verify(signature, b"m", prehashed=False, options=DEFAULT)
    assert not key.verify(signature, b"m", prehashed=False, options=empty)
    signature = key.sign(b"m", prehashed=False, options=empty)
    assert key.verify(signature, b"m", prehashed=False, options=empty)
    assert not key.verify(signature, b"m", prehashed=False, options=DEFAULT)
    explicit_default = SignOptions(signer_id=DEFAULT_SIGNER_ID)
    signature = key.sign(b"m", prehashed=False, options=DEFAULT)
    assert key.verify(signature, b"m", prehashed=False, options=explicit_default)


def test_signer_id_length_limit(key: Sm2Key) -> None:
    longest = SignOptions(signer_id=b"i" * 255)
    signature = key.sign(b"m", prehashed=False, options=longest)
    assert key.verify(signature, b"m", prehashed=False, options=longest)
    with pytest.raises(InvalidOptions):
        key.sign(b"m", prehashed=False, options=SignOptions(signer_id=b"i" * 256))
    with pytest.raises(InvalidOptions):
        key.verify(signature, b"m", prehashed=False, options=SignOptions(signer_id=b"i" * 256))


def test_digest_and_message_signatures_agree(key: Sm2Key) -> None:
    message = b"signed as a digest"
    for signer_id in (DEFAULT_SIGNER_ID, b"", b"bob@example.com"):
        e = message_digest(key.public_point, message, signer_id)
        by_digest = key.sign(e, prehashed=True, options=DEFAULT)
        options = SignOptions(signer_id=signer_id)
        assert key.verify(by_digest, message, prehashed=False, options=options)
        by_message = key.sign(message, prehashed=False, options=options)
        assert key.verify(by_message, e, prehashed=True, options=DEFAULT)
    large = b"\xa5" * (1 << 20)
    signature = key.sign(large, prehashed=False, options=DEFAULT)
    e = message_digest(key.public_point, large)
    assert key.verify(signature, e, prehashed=True, options=DEFAULT)


@pytest.mark.parametrize(
    "options",
    [
        SignOptions(algorithm="pss"),
        SignOptions(algorithm="sm2"),
        SignOptions(encoding="p1363"),
        SignOptions(encoding="DER"),
    ],
)
def test_options_that_do_not_apply_are_refused(key: Sm2Key, options: SignOptions) -> None:
    with pytest.raises(InvalidOptions):
        key.sign(b"m", prehashed=False, options=options)
    with pytest.raises(InvalidOptions):
        key.verify(b"\x30\x00", b"m", prehashed=False, options=options)


def test_digest_rules(key: Sm2Key) -> None:
    e = message_digest(key.public_point, b"m")
    for digest in (e[:31], e + b"\x00", b""):
        with pytest.raises(InvalidOptions):
            key.sign(digest, prehashed=True, options=DEFAULT)
        with pytest.raises(InvalidOptions):
            key.verify(b"\x30\x00", digest, prehashed=True, options=DEFAULT)
    # the signer ID is inside e already: sending one with a digest is a mistake
    for signer_id in (b"", DEFAULT_SIGNER_ID):
        with pytest.raises(InvalidOptions):
            key.sign(e, prehashed=True, options=SignOptions(signer_id=signer_id))
        with pytest.raises(InvalidOptions):
            key.verify(b"", e, prehashed=True, options=SignOptions(signer_id=signer_id))


def _der(r: int, s: int) -> bytes:
    return codec.tlv(0x30, codec.der_integer(r) + codec.der_integer(s))


def test_verify_is_false_for_anything_that_is_not_a_signature(
    key: Sm2Key, other_key: Sm2Key
) -> None:
    raw = key.sign(b"m", prehashed=False, options=RAW)
    der = key.sign(b"m", prehashed=False, options=DEFAULT)
    r, s = int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big")
    n = codec.N
    not_raw = [b"", raw[:63], raw + b"\x00", raw[1:], bytes(64), b"\xff" * 64]
    not_raw += [(n).to_bytes(32, "big") + raw[32:], raw[:32] + (n).to_bytes(32, "big")]
    not_raw += [(r + n).to_bytes(33, "big")[1:] + raw[32:]]  # wraps to a different value
    not_raw += [other_key.sign(b"m", prehashed=False, options=RAW)]
    for candidate in not_raw:
        assert not key.verify(candidate, b"m", prehashed=False, options=RAW), candidate.hex()
    not_der = [b"", b"\x30", b"\x30\x00", der[:-1], der + b"\x00", flip(der, 0), flip(der, 1)]
    not_der += [_der(0, s), _der(r, 0), _der(n, s), _der(r, n), _der(r + n, s), _der(r, s + n)]
    not_der += [codec.tlv(0x30, codec.tlv(0x02, b"\x00" + r.to_bytes(33, "big")) + der[-34:])]
    not_der += [b"\x30\x81" + der[1:], der * 2, b"\x00" * 4096]
    not_der += [other_key.sign(b"m", prehashed=False, options=DEFAULT)]
    for candidate in not_der:
        assert not key.verify(candidate, b"m", prehashed=False, options=DEFAULT), candidate.hex()
    assert not key.verify(der, b"M", prehashed=False, options=DEFAULT)
    assert key.verify(_der(r, s), b"m", prehashed=False, options=DEFAULT)  # the control


# --- keys ---------------------------------------------------------------------------------------


def test_key_type_definition() -> None:
    assert SM2.name == "sm2"
    assert SM2.type_id == 8
    assert SM2.operations == frozenset({"encrypt", "decrypt", "sign", "verify"})
    assert SM2.asymmetric
    assert SM2.external_formats == frozenset({"sm2", "sm2-c1c2c3"})
    assert SM2.sign_digest_size == 32
    handle = SM2.load(SM2.generate())
    assert isinstance(handle, Sm2Key)
    assert handle.type_name == "sm2"


def test_generated_material_is_a_scalar_in_range() -> None:
    seen = set()
    for _ in range(20):
        material = generate()
        assert len(material) == 32
        assert 1 <= int.from_bytes(material, "big") <= codec.N - 2
        seen.add(material)
    assert len(seen) == 20


def test_public_key_exports(key: Sm2Key) -> None:
    pem = key.public_key_pem()
    lines = pem.strip().splitlines()
    assert lines[0] == "-----BEGIN PUBLIC KEY-----"
    assert lines[-1] == "-----END PUBLIC KEY-----"
    assert all(len(line) <= 64 for line in lines)
    der = base64.b64decode("".join(lines[1:-1]))
    # SEQUENCE { SEQUENCE { id-ecPublicKey, 1.2.156.10197.1.301 }, BIT STRING 04 || x || y }
    assert der == SPKI_PREFIX + key.public_point
    raw = key.public_key_raw()
    assert raw == key.public_point.hex()
    assert len(raw) == 130
    assert raw.startswith("04")


def test_import_hex_scalar(standard_key: Sm2Key) -> None:
    for text in (VECTORS["private_key"], VECTORS["private_key"].upper()):
        material = import_key(f"  {text}\n".encode())
        assert material == bytes.fromhex(VECTORS["private_key"])
        assert load(material).public_key_raw() == VECTORS["public_key"]


def _pem(label: str, der: bytes) -> bytes:
    body = base64.encodebytes(der).decode().replace("\n", "")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return (
        "\n".join([f"-----BEGIN {label}-----", *lines, f"-----END {label}-----"]) + "\n"
    ).encode()


def _sec1(scalar: bytes, public_point: bytes | None = None) -> bytes:
    body = codec.der_integer(1) + codec.tlv(0x04, scalar) + codec.tlv(0xA0, codec.SM2_CURVE_OID)
    if public_point is not None:
        body += codec.tlv(0xA1, codec.tlv(0x03, b"\x00" + public_point))
    return codec.tlv(0x30, body)


def _pkcs8(scalar: bytes) -> bytes:
    algorithm = codec.tlv(0x30, bytes.fromhex("06072a8648ce3d0201") + codec.SM2_CURVE_OID)
    sec1 = codec.tlv(0x30, codec.der_integer(1) + codec.tlv(0x04, scalar))
    return codec.tlv(0x30, codec.der_integer(0) + algorithm + codec.tlv(0x04, sec1))


def test_import_pem_and_der_forms() -> None:
    scalar = bytes.fromhex(VECTORS["private_key"])
    point = bytes.fromhex(VECTORS["public_key"])
    accepted = [
        _pem("PRIVATE KEY", _pkcs8(scalar)),
        _pem("EC PRIVATE KEY", _sec1(scalar)),
        _pem("EC PRIVATE KEY", _sec1(scalar, point)),
        _pem("SM2 PRIVATE KEY", _sec1(scalar, point)),
        _pem("SM2 PARAMETERS", codec.SM2_CURVE_OID) + _pem("EC PRIVATE KEY", _sec1(scalar)),
        _pkcs8(scalar),
    ]
    for data in accepted:
        assert import_key(data) == scalar


def test_import_boundaries() -> None:
    n = codec.N
    for value in (1, n - 2):
        assert import_key(f"{value:064x}".encode()) == value.to_bytes(32, "big")
    for value in (0, n - 1, n, 2**256 - 1):
        with pytest.raises(InvalidKeyMaterial):
            import_key(f"{value:064x}".encode())


def test_import_refusals_do_not_echo_the_input() -> None:
    scalar = bytes.fromhex(VECTORS["private_key"])
    other_point = load(generate()).public_point
    p256 = ec.generate_private_key(ec.SECP256R1())
    p256_pem = p256.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    encrypted = p256.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"password"),
    )
    public = load(scalar).public_key_pem().encode()
    refused = {
        "short hex": VECTORS["private_key"][:-1].encode(),
        "long hex": (VECTORS["private_key"] + "0").encode(),
        "not hex": b"g" * 64,
        "P-256": p256_pem,
        "encrypted PKCS#8": encrypted,
        "encrypted SEC1": _pem("EC PRIVATE KEY", _sec1(scalar)).replace(
            b"KEY-----\n", b"KEY-----\nProc-Type: 4,ENCRYPTED\n\n", 1
        ),
        "public key": public,
        "two keys": _pem("PRIVATE KEY", _pkcs8(scalar)) * 2,
        "bad base64": _pem("PRIVATE KEY", _pkcs8(scalar)).replace(b"M", b"!", 1),
        "mismatched public key": _pem("EC PRIVATE KEY", _sec1(scalar, other_point)),
        "trailing bytes": _pkcs8(scalar) + b"\x00",
        "empty": b"",
    }
    for name, data in refused.items():
        with pytest.raises(InvalidKeyMaterial) as caught:
            import_key(data)
        message = str(caught.value)
        assert VECTORS["private_key"][:16] not in message.lower(), name
        assert "MII" not in message, name
        assert "-----" not in message, name


def test_load_refuses_bad_material() -> None:
    for material in (b"", bytes(31), bytes(33), bytes(32)):
        with pytest.raises(InvalidKeyMaterial):
            load(material)


def test_handles_refuse_pickling(key: Sm2Key) -> None:
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(TypeError):
        pickle.dumps(key._key)
    assert "sm2" in repr(key)
    assert VECTORS["private_key"][:8] not in repr(load(bytes.fromhex(VECTORS["private_key"])))


# --- the binding --------------------------------------------------------------------------------


def test_libcrypto_is_openssl_3_with_sm2() -> None:
    assert _libcrypto.available()
    assert _libcrypto.version().startswith("OpenSSL 3.")


def test_failures_leave_no_error_in_the_queue(key: Sm2Key) -> None:
    crypto = _libcrypto.lib()
    crypto.ERR_clear_error()
    ciphertext = key.encrypt_raw(b"x")
    with pytest.raises(InvalidCiphertext):
        key.decrypt_external(flip(ciphertext, 70), "sm2")
    assert crypto.ERR_peek_error() == 0
    assert not key.verify(b"\x30\x00", b"m", prehashed=False, options=DEFAULT)
    assert crypto.ERR_peek_error() == 0
    with pytest.raises(InvalidKeyMaterial):
        import_key(_pem("PRIVATE KEY", b"\x30\x03\x02\x01\x00"))
    assert crypto.ERR_peek_error() == 0
    assert key.decrypt_external(ciphertext, "sm2") == b"x"


def test_one_key_is_safe_to_use_from_many_threads(key: Sm2Key) -> None:
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for round_ in range(25):
                message = f"{index}-{round_}".encode()
                signature = key.sign(message, prehashed=False, options=DEFAULT)
                assert key.verify(signature, message, prehashed=False, options=DEFAULT)
                assert not key.verify(signature, message + b"!", prehashed=False, options=DEFAULT)
                assert key.decrypt(key.encrypt(message, b"a"), b"a") == message
                with pytest.raises(InvalidCiphertext):
                    key.decrypt_external(flip(key.encrypt_raw(message), 70), "sm2")
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_libcrypto_calls_release_the_gil(key: Sm2Key) -> None:
    """While one thread is inside a long libcrypto call (SM2-encrypting 8 MiB: one call, its
    KDF and C3 run in C), another thread keeps running Python. A call holding the GIL would
    freeze it for the whole middle of the call. Progress is counted, not timed."""
    window: list[float] = []

    def encrypt() -> None:
        plaintext = bytes(8 << 20)
        window.append(time.perf_counter())
        key._key.encrypt(plaintext)
        window.append(time.perf_counter())

    stamps: list[float] = []
    worker = threading.Thread(target=encrypt)
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
    worker.join()
    start, end = window
    margin = (end - start) / 5
    inside = [t for t in stamps if start + margin < t < end - margin]
    assert len(inside) > 100
