"""Composite ML-DSA key types in the crypto layer: the published test vectors of
draft-ietf-lamps-pq-composite-sigs-19, each half of cryptd's signatures checked by another
implementation, tampered halves, options and import.

Vectors: tests/vectors/composite_mldsa_draft19.json holds the draft's cases for
id-MLDSA65-ECDSA-P256-SHA512 and id-MLDSA65-Ed25519-SHA512 unchanged (src/testvectors.json of
github.com/lamps-wg/draft-composite-sigs at tag draft-ietf-lamps-pq-composite-sigs-19), and one
``ml-dsa-65-sm2`` case made by cryptd (no outside vectors exist for cryptd's own type; its
halves are checked here by dilithium-py and gmssl, so the vector pins the construction).
Outside checks: dilithium-py (ML-DSA), pyca/cryptography (ECDSA, Ed25519), gmssl (SM2).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from dilithium_py.ml_dsa import ML_DSA_65

from service.crypto import _sm2_codec as codec
from service.crypto import composite
from service.crypto.base import NO_OPTIONS, InvalidKeyMaterial, InvalidOptions, SignOptions
from service.crypto.composite import CompositeKey
from service.crypto.registry import KEY_TYPES

VECTORS = json.loads(
    (Path(__file__).parent / "vectors" / "composite_mldsa_draft19.json").read_text()
)
MESSAGE = base64.b64decode(VECTORS["m"])
CONTEXT = base64.b64decode(VECTORS["ctx"])
CASES = {case["type"]: case for case in VECTORS["tests"]}
TYPES = ("ml-dsa-65-ecdsa-p256", "ml-dsa-65-ed25519", "ml-dsa-65-sm2")
DRAFT_TYPES = TYPES[:2]
LABELS = {
    "ml-dsa-65-ecdsa-p256": b"COMPSIG-MLDSA65-ECDSA-P256-SHA512",
    "ml-dsa-65-ed25519": b"COMPSIG-MLDSA65-Ed25519-SHA512",
    "ml-dsa-65-sm2": b"CRYPTD-COMPSIG-MLDSA65-SM2-SHA512",
}
OIDS = {"ml-dsa-65-ecdsa-p256": "1.3.6.1.5.5.7.6.45", "ml-dsa-65-ed25519": "1.3.6.1.5.5.7.6.48"}
MLDSA_PK, MLDSA_SIG = 1952, 3309


def b(case: dict[str, Any], field: str) -> bytes:
    return base64.b64decode(case[field])


def ctx(value: bytes | None) -> SignOptions:
    return SignOptions(context=value)


def m_prime(type_name: str, message: bytes, context: bytes = b"") -> bytes:
    """M' written out from the draft's section 2.2 (not cryptd's function)."""
    return (
        b"CompositeAlgorithmSignatures2025"
        + LABELS[type_name]
        + bytes([len(context)])
        + context
        + hashlib.sha512(message).digest()
    )


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def trad_verifies(type_name: str, public: bytes, signature: bytes, message: bytes) -> bool:
    """The traditional half checked outside cryptd: pyca for ECDSA and Ed25519, gmssl for SM2."""
    try:
        if type_name == "ml-dsa-65-ecdsa-p256":
            key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), public)
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        elif type_name == "ml-dsa-65-ed25519":
            ed25519.Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        else:
            from gmssl import sm2 as gm

            raw = codec.signature_to_raw(signature)
            assert raw is not None
            crypt = gm.CryptSM2(private_key="", public_key="", mode=1)
            crypt.public_key = public[1:].hex()  # x || y (see tests/test_sm2_interop.py)
            return bool(crypt.verify_with_sm3(raw.hex(), message))
    except InvalidSignature:
        return False
    return True


# The draft's vectors ----------------------------------------------------------------------------


def test_vectors_are_the_drafts() -> None:
    assert [c["tcId"] for c in VECTORS["tests"]] == [
        "id-MLDSA65-ECDSA-P256-SHA512",
        "id-MLDSA65-Ed25519-SHA512",
        "cryptd-MLDSA65-SM2-SHA512",
    ]
    assert MESSAGE == b"The quick brown fox jumps over the lazy dog."
    assert composite.DRAFT == "draft-ietf-lamps-pq-composite-sigs-19"


@pytest.mark.parametrize("type_name", TYPES)
def test_known_answers(type_name: str) -> None:
    """The vector's private key imports unchanged and gives its public key; both signatures
    (empty and the draft's context) verify, each under its own context only; a flipped byte
    in either half, a truncation or another message does not."""
    case, key_type = CASES[type_name], KEY_TYPES[type_name]
    assert key_type.import_key is not None
    material = key_type.import_key(b(case, "sk"))
    assert material == b(case, "sk")  # the draft's private key encoding is the material
    handle = key_type.load(material)
    assert bytes.fromhex(handle.public_key_raw() or "") == b(case, "pk")
    plain, with_context = b(case, "s"), b(case, "sWithContext")
    assert handle.verify(plain, MESSAGE, prehashed=False, options=NO_OPTIONS)
    assert handle.verify(with_context, MESSAGE, prehashed=False, options=ctx(CONTEXT))
    assert not handle.verify(plain, MESSAGE, prehashed=False, options=ctx(CONTEXT))
    assert not handle.verify(with_context, MESSAGE, prehashed=False, options=NO_OPTIONS)
    for bad in (
        flip(plain, 100),  # the ML-DSA half
        flip(plain, len(plain) - 5),  # the traditional half
        plain[:MLDSA_SIG],
        plain[:-1],
        plain[: MLDSA_SIG - 1],
        b"",
    ):
        assert not handle.verify(bad, MESSAGE, prehashed=False, options=NO_OPTIONS)
    assert not handle.verify(plain, MESSAGE + b" ", prehashed=False, options=NO_OPTIONS)


@pytest.mark.parametrize("type_name", DRAFT_TYPES)
def test_pkcs8_and_certificate_of_the_vectors(type_name: str) -> None:
    """sk_pkcs8 (OneAsymmetricKey under the composite OID, DER and PEM) imports as sk; the
    public key PEM is the SubjectPublicKeyInfo of the vector's certificate, whose self-signature
    verifies with cryptd's verify."""
    case, key_type = CASES[type_name], KEY_TYPES[type_name]
    assert key_type.import_key is not None
    pkcs8 = b(case, "sk_pkcs8")
    assert key_type.import_key(pkcs8) == b(case, "sk")
    pem = (
        b"-----BEGIN PRIVATE KEY-----\n"
        + base64.encodebytes(pkcs8)
        + b"-----END PRIVATE KEY-----\n"
    )
    assert key_type.import_key(pem) == b(case, "sk")
    handle = key_type.load(b(case, "sk"))
    certificate = x509.load_der_x509_certificate(b(case, "x5c"))
    assert certificate.signature_algorithm_oid.dotted_string == OIDS[type_name]
    spki = base64.b64decode("".join((handle.public_key_pem() or "").splitlines()[1:-1]))
    assert spki in certificate.tbs_certificate_bytes
    assert spki.endswith(b(case, "pk"))
    assert handle.verify(
        certificate.signature,
        certificate.tbs_certificate_bytes,
        prehashed=False,
        options=NO_OPTIONS,
    )


@pytest.mark.parametrize("type_name", TYPES)
def test_vector_halves_verify_outside_cryptd(type_name: str) -> None:
    """The vectors' two halves checked by dilithium-py (over M', with the label as the FIPS 204
    context) and by pyca or gmssl (over M'): for the SM2 vector this is its outside check."""
    case = CASES[type_name]
    public = b(case, "pk")
    for signature, context in ((b(case, "s"), b""), (b(case, "sWithContext"), CONTEXT)):
        message = m_prime(type_name, MESSAGE, context)
        first, second = signature[:MLDSA_SIG], signature[MLDSA_SIG:]
        assert ML_DSA_65.verify(public[:MLDSA_PK], message, first, ctx=LABELS[type_name])
        assert not ML_DSA_65.verify(public[:MLDSA_PK], message, first)
        assert trad_verifies(type_name, public[MLDSA_PK:], second, message)
        assert not trad_verifies(type_name, public[MLDSA_PK:], second, message[:-1] + b"\x00")


# cryptd's signatures ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TYPES)
def fresh(request: pytest.FixtureRequest) -> tuple[str, CompositeKey]:
    type_name: str = request.param
    handle = KEY_TYPES[type_name].load(KEY_TYPES[type_name].generate())
    assert isinstance(handle, CompositeKey)
    return type_name, handle


@pytest.mark.parametrize("context", [None, b"", b"invoice:2026", bytes(range(255))])
def test_sign_verify_and_each_half_outside(
    fresh: tuple[str, CompositeKey], context: bytes | None
) -> None:
    type_name, handle = fresh
    message = os.urandom(300)
    signature = handle.sign(message, prehashed=False, options=ctx(context))
    assert handle.verify(signature, message, prehashed=False, options=ctx(context))
    other = b"other" if context else b"x"
    assert not handle.verify(signature, message, prehashed=False, options=ctx(other))
    public = bytes.fromhex(handle.public_key_raw())
    representative = m_prime(type_name, message, context or b"")
    first, second = signature[:MLDSA_SIG], signature[MLDSA_SIG:]
    assert ML_DSA_65.verify(public[:MLDSA_PK], representative, first, ctx=LABELS[type_name])
    assert trad_verifies(type_name, public[MLDSA_PK:], second, representative)


def test_one_valid_half_is_not_enough(fresh: tuple[str, CompositeKey]) -> None:
    """A good ML-DSA half with a bad traditional one, and the other way round, are invalid; so
    is a half from another key's signature of the same message."""
    type_name, handle = fresh
    signature = handle.sign(b"m", prehashed=False, options=NO_OPTIONS)
    other = KEY_TYPES[type_name].load(KEY_TYPES[type_name].generate())
    theirs = other.sign(b"m", prehashed=False, options=NO_OPTIONS)
    for bad in (
        flip(signature, 0),
        flip(signature, MLDSA_SIG - 1),
        flip(signature, MLDSA_SIG + 8),
        flip(signature, len(signature) - 1),
        signature[:MLDSA_SIG] + theirs[MLDSA_SIG:],
        theirs[:MLDSA_SIG] + signature[MLDSA_SIG:],
        signature[:-1],
        signature + b"\x00",
    ):
        assert not handle.verify(bad, b"m", prehashed=False, options=NO_OPTIONS)
    # Hedged ML-DSA (and randomized ECDSA, SM2): two signatures differ, both verify.
    again = handle.sign(b"m", prehashed=False, options=NO_OPTIONS)
    assert again[:MLDSA_SIG] != signature[:MLDSA_SIG]
    assert handle.verify(again, b"m", prehashed=False, options=NO_OPTIONS)
    # Not strongly unforgeable, as the draft says and docs/FORMAT.md repeats: halves of two
    # signatures of one message by one key recombine.
    mixed = signature[:MLDSA_SIG] + again[MLDSA_SIG:]
    assert handle.verify(mixed, b"m", prehashed=False, options=NO_OPTIONS)


def test_public_key_pem(fresh: tuple[str, CompositeKey]) -> None:
    type_name, handle = fresh
    pem = handle.public_key_pem()
    raw = bytes.fromhex(handle.public_key_raw())
    assert len(raw) == MLDSA_PK + (32 if type_name == "ml-dsa-65-ed25519" else 65)
    if type_name == "ml-dsa-65-sm2":
        assert pem.startswith("-----BEGIN ML-DSA-65-SM2 PUBLIC KEY-----\n")
        assert base64.b64decode("".join(pem.splitlines()[1:-1])) == raw
        return
    spki = base64.b64decode("".join(pem.splitlines()[1:-1]))
    assert spki.endswith(b"\x03\x82" + (len(raw) + 1).to_bytes(2, "big") + b"\x00" + raw)
    # pyca parses the SubjectPublicKeyInfo and names its algorithm, which it does not support.
    with pytest.raises(UnsupportedAlgorithm, match=f"Unknown key type: {OIDS[type_name]}$"):
        serialization.load_pem_public_key(pem.encode())


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ({"context": b"x" * 256}, "at most 255"),
        ({"message_type": "external_mu"}, "message_type must be 'raw'"),
        ({"message_type": "external_mu", "context": b"c"}, "message_type must be 'raw'"),
        ({"algorithm": "pss"}, "'algorithm'"),
        ({"encoding": "raw"}, "'encoding'"),
        ({"signer_id": b"1"}, "'signer_id'"),
        ({"hash_algorithm": "sha2-256"}, "'hash_algorithm'"),
    ],
)
def test_bad_options(fresh: tuple[str, CompositeKey], values: dict[str, Any], text: str) -> None:
    _, handle = fresh
    with pytest.raises(InvalidOptions, match=text):
        handle.sign(bytes(64), prehashed=False, options=SignOptions(**values))
    with pytest.raises(InvalidOptions, match=text):
        handle.verify(bytes(3400), bytes(64), prehashed=False, options=SignOptions(**values))
    with pytest.raises(InvalidOptions, match="messages only"):
        handle.sign(bytes(64), prehashed=True, options=NO_OPTIONS)
    raw = SignOptions(message_type="raw")
    assert handle.verify(
        handle.sign(b"m", prehashed=False, options=raw), b"m", prehashed=False, options=raw
    )


# Import and material ----------------------------------------------------------------------------


def test_import_canonicalizes_the_ecdsa_part_and_refuses_others() -> None:
    import_key = KEY_TYPES["ml-dsa-65-ecdsa-p256"].import_key
    assert import_key is not None
    seed = os.urandom(32)
    private = ec.generate_private_key(ec.SECP256R1())
    with_public = private.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    material = import_key(seed + with_public)
    assert material[:32] == seed
    assert material != seed + with_public
    assert len(material) == 32 + 51  # ECPrivateKey without the public key
    handle = KEY_TYPES["ml-dsa-65-ecdsa-p256"].load(material)
    point = private.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    assert bytes.fromhex(handle.public_key_raw() or "").endswith(point)
    p384 = ec.generate_private_key(ec.SECP384R1()).private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    for bad in (seed + p384, seed, seed + b"\x30\x00", b"", os.urandom(83)):
        with pytest.raises(InvalidKeyMaterial):
            import_key(bad)


def test_import_refuses_another_algorithms_pkcs8() -> None:
    ed_import = KEY_TYPES["ml-dsa-65-ed25519"].import_key
    assert ed_import is not None
    with pytest.raises(InvalidKeyMaterial, match="another algorithm"):
        ed_import(b(CASES["ml-dsa-65-ecdsa-p256"], "sk_pkcs8"))
    ed = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(InvalidKeyMaterial, match="another algorithm"):
        ed_import(ed)
    truncated = b(CASES["ml-dsa-65-ed25519"], "sk_pkcs8")[:-1]
    with pytest.raises(InvalidKeyMaterial):
        ed_import(truncated)


@pytest.mark.parametrize(("type_name", "tail"), [("ml-dsa-65-ed25519", 32), ("ml-dsa-65-sm2", 32)])
def test_import_raw_and_sizes(type_name: str, tail: int) -> None:
    key_type = KEY_TYPES[type_name]
    assert key_type.import_key is not None
    material = key_type.generate()
    assert len(material) == 32 + tail
    assert key_type.import_key(material) == material
    for size in (0, 32, 33, 63, 65):
        with pytest.raises(InvalidKeyMaterial):
            key_type.import_key(material[:size] if size <= len(material) else material + b"\x00")
        with pytest.raises(InvalidKeyMaterial):
            key_type.load(material[:size] if size <= len(material) else material + b"\x00")
    if type_name == "ml-dsa-65-sm2":  # scalar 0 and n-1 are not SM2 keys
        for scalar in (0, codec.N - 1):
            with pytest.raises(InvalidKeyMaterial):
                key_type.import_key(material[:32] + scalar.to_bytes(32, "big"))


@pytest.mark.parametrize("type_name", DRAFT_TYPES)
def test_pkcs8_version_2_with_its_public_key(type_name: str) -> None:
    """OneAsymmetricKey v2 may carry the composite public key [1]: taken when it is the private
    key's, refused when it is another's; nothing may follow it."""
    case, import_key = CASES[type_name], KEY_TYPES[type_name].import_key
    assert import_key is not None
    pkcs8 = b(case, "sk_pkcs8")
    outer = codec.read_tlv(pkcs8, 0, 0x30)
    assert outer is not None
    body = outer[0]
    assert body[:3] == b"\x02\x01\x00"

    def v2(public: bytes, extra: bytes = b"") -> bytes:
        return codec.tlv(
            0x30, b"\x02\x01\x01" + body[3:] + codec.tlv(0x81, b"\x00" + public) + extra
        )

    assert import_key(v2(b(case, "pk"))) == b(case, "sk")
    with pytest.raises(InvalidKeyMaterial, match="not the private key's"):
        import_key(v2(flip(b(case, "pk"), 40)))
    with pytest.raises(InvalidKeyMaterial, match="not a composite PKCS#8"):
        import_key(v2(b(case, "pk"), b"\x05\x00"))
    with pytest.raises(InvalidKeyMaterial, match="not a composite PKCS#8"):
        import_key(codec.tlv(0x30, body + b"\x05\x00"))  # v1 with a stray element
