"""Post-quantum key types in the crypto layer: FIPS 204 / FIPS 203 known-answer vectors, the
HPKE test vectors of draft-ietf-hpke-pq, options and bad input, import of seeds, and tampered
HPKE bodies.

Vectors (tests/vectors/, taken from pyca/cryptography's published cryptography_vectors 50.0.2):
fips204_ml_dsa_kat.json, fips203_ml_kem_kat.json, hpke_pq.json, mldsa44_priv.der (PKCS#8 seed
form), mldsa65_noseed_priv.der (PKCS#8 expanded form only).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric import mldsa, mlkem

from service.crypto import mlkem as cryptd_mlkem
from service.crypto.base import (
    NO_OPTIONS,
    InvalidCiphertext,
    InvalidKeyMaterial,
    InvalidOptions,
    KeyHandle,
    SignOptions,
)
from service.crypto.mldsa import MlDsaKey
from service.crypto.mlkem import HpkeKey
from service.crypto.registry import KEY_TYPES

VECTORS = Path(__file__).parent / "vectors"
MLDSA = json.loads((VECTORS / "fips204_ml_dsa_kat.json").read_text())["sets"]
MLKEM = json.loads((VECTORS / "fips203_ml_kem_kat.json").read_text())["sets"]
HPKE = json.loads((VECTORS / "hpke_pq.json").read_text())["vectors"]
MLDSA_TYPES = ("ml-dsa-44", "ml-dsa-65", "ml-dsa-87")
KEM_TYPES = ("ml-kem-768", "ml-kem-1024", "x25519-ml-kem-768")
SIGNATURE_SIZES = {"ml-dsa-44": 2420, "ml-dsa-65": 3309, "ml-dsa-87": 4627}
ENC_SIZES = {"ml-kem-768": 1088, "ml-kem-1024": 1568, "x25519-ml-kem-768": 1120}
# HPKE ids (RFC 9180 and draft-ietf-hpke-pq) -> pyca's objects and cryptd's key types.
KEMS = {
    0x0041: (hpke.KEM.MLKEM768, "ml-kem-768"),
    0x0042: (hpke.KEM.MLKEM1024, "ml-kem-1024"),
    0x647A: (hpke.KEM.MLKEM768_X25519, "x25519-ml-kem-768"),
}
KDFS = {1: hpke.KDF.HKDF_SHA256, 2: hpke.KDF.HKDF_SHA384}
AEADS = {1: hpke.AEAD.AES_128_GCM, 2: hpke.AEAD.AES_256_GCM, 3: hpke.AEAD.CHACHA20_POLY1305}


MLDSA_PUBLIC = (mldsa.MLDSA44PublicKey, mldsa.MLDSA65PublicKey, mldsa.MLDSA87PublicKey)


def load(type_name: str, material: bytes) -> KeyHandle:
    return KEY_TYPES[type_name].load(material)


def raw_public(handle: KeyHandle) -> bytes:
    pem = handle.public_key_pem()
    assert pem is not None
    public = serialization.load_pem_public_key(pem.encode())
    assert isinstance(
        public, mldsa.MLDSA44PublicKey | mldsa.MLDSA65PublicKey | mldsa.MLDSA87PublicKey
    )
    return public.public_bytes_raw()


def options(**values: Any) -> SignOptions:
    return SignOptions(**values)


# ML-DSA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", MLDSA_TYPES)
def test_mldsa_known_answers(type_name: str) -> None:
    """FIPS 204 KAT: the seed xi gives the published public key, and the published signature
    (deterministic variant, with its context) verifies; a changed byte, context or message
    does not."""
    assert len(MLDSA[type_name]) == 3
    for case in MLDSA[type_name]:
        handle = load(type_name, bytes.fromhex(case["xi"]))
        assert raw_public(handle) == bytes.fromhex(case["pk"])
        signature, message = bytes.fromhex(case["signature"]), bytes.fromhex(case["msg"])
        context = options(context=bytes.fromhex(case["ctx"]))
        assert len(signature) == SIGNATURE_SIZES[type_name]
        assert handle.verify(signature, message, prehashed=False, options=context)
        flipped = bytes([signature[0] ^ 1]) + signature[1:]
        assert not handle.verify(flipped, message, prehashed=False, options=context)
        assert not handle.verify(signature, message + b"x", prehashed=False, options=context)
        assert not handle.verify(signature, message, prehashed=False, options=options(context=b"x"))


@pytest.mark.parametrize("type_name", MLDSA_TYPES)
def test_mldsa_signs_with_context_and_external_mu(type_name: str) -> None:
    key_type = KEY_TYPES[type_name]
    seed = key_type.generate()
    assert len(seed) == 32
    handle = load(type_name, seed)
    message, context = os.urandom(100), os.urandom(255)
    signed = handle.sign(message, prehashed=False, options=options(context=context))
    assert len(signed) == SIGNATURE_SIZES[type_name]
    assert handle.verify(signed, message, prehashed=False, options=options(context=context))
    assert not handle.verify(signed, message, prehashed=False, options=NO_OPTIONS)
    # mu as FIPS 204 section 6.2 computes it, by pyca's hasher: the signature over mu is the
    # signature over the message with that context, both ways.
    public = serialization.load_pem_public_key((handle.public_key_pem() or "").encode())
    assert isinstance(public, MLDSA_PUBLIC)
    hasher = mldsa.MLDSAMuHasher(public, context)
    hasher.update(message)
    mu = hasher.finalize()
    external = options(message_type="external_mu")
    by_mu = handle.sign(mu, prehashed=False, options=external)
    assert handle.verify(by_mu, message, prehashed=False, options=options(context=context))
    assert handle.verify(signed, mu, prehashed=False, options=external)
    assert not handle.verify(signed, bytes(64), prehashed=False, options=external)
    # Hedged signing: two signatures differ and both verify.
    again = handle.sign(message, prehashed=False, options=options(context=context))
    assert again != signed


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ({"context": b"x" * 256}, "at most 255"),
        ({"message_type": "external_mu", "context": b""}, "mu already binds"),
        ({"message_type": "prehash"}, "'raw' or 'external_mu'"),
        ({"algorithm": "pss"}, "'algorithm'"),
        ({"encoding": "raw"}, "'encoding'"),
        ({"signer_id": b"1"}, "'signer_id'"),
        ({"hash_algorithm": "sha2-256"}, "'hash_algorithm'"),
    ],
)
def test_mldsa_refuses_bad_options(values: dict[str, Any], text: str) -> None:
    handle = load("ml-dsa-44", KEY_TYPES["ml-dsa-44"].generate())
    bad = options(**values)
    message = bytes(64)
    with pytest.raises(InvalidOptions, match=text):
        handle.sign(message, prehashed=False, options=bad)
    with pytest.raises(InvalidOptions, match=text):
        handle.verify(bytes(2420), message, prehashed=False, options=bad)


@pytest.mark.parametrize("size", [0, 32, 63, 65, 128])
def test_mldsa_external_mu_must_be_64_bytes(size: int) -> None:
    handle = load("ml-dsa-65", KEY_TYPES["ml-dsa-65"].generate())
    external = options(message_type="external_mu")
    with pytest.raises(InvalidOptions, match="64-byte mu"):
        handle.sign(bytes(size), prehashed=False, options=external)
    with pytest.raises(InvalidOptions, match="64-byte mu"):
        handle.verify(bytes(3309), bytes(size), prehashed=False, options=external)


@pytest.mark.parametrize("type_name", MLDSA_TYPES)
def test_mldsa_signatures_of_any_other_length_are_invalid_not_errors(type_name: str) -> None:
    handle = load(type_name, KEY_TYPES[type_name].generate())
    signed = handle.sign(b"m", prehashed=False, options=NO_OPTIONS)
    for bad in (b"", signed[:-1], signed + b"\x00", bytes(len(signed))):
        assert not handle.verify(bad, b"m", prehashed=False, options=NO_OPTIONS)


def test_mldsa_import_takes_a_seed_raw_or_in_pkcs8() -> None:
    import_key = KEY_TYPES["ml-dsa-44"].import_key
    assert import_key is not None
    seed_form = (VECTORS / "mldsa44_priv.der").read_bytes()
    private = serialization.load_der_private_key(seed_form, None)
    assert isinstance(private, mldsa.MLDSA44PrivateKey)
    seed = private.private_bytes_raw()
    assert import_key(seed_form) == seed
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert import_key(pem) == seed
    assert import_key(seed) == seed
    assert raw_public(load("ml-dsa-44", seed)) == private.public_key().public_bytes_raw()
    # Another parameter set, a non-seed PKCS#8, other sizes, other key types: refused.
    with pytest.raises(InvalidKeyMaterial, match="not an ml-dsa-44"):
        import_key(
            mldsa.MLDSA65PrivateKey.generate().private_bytes(
                serialization.Encoding.DER,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    import65 = KEY_TYPES["ml-dsa-65"].import_key
    assert import65 is not None
    with pytest.raises(InvalidKeyMaterial):
        import65((VECTORS / "mldsa65_noseed_priv.der").read_bytes())
    for size in (0, 16, 31, 33, 64):
        with pytest.raises(InvalidKeyMaterial):
            import_key(os.urandom(size))
    with pytest.raises(InvalidKeyMaterial):
        KEY_TYPES["ml-dsa-44"].load(bytes(31))


# ML-KEM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["ml-kem-768", "ml-kem-1024"])
def test_mlkem_known_answers(type_name: str) -> None:
    """FIPS 203 KAT: seed d || z gives the published encapsulation key; decapsulation of the
    published ciphertext gives its secret, and of the invalid ciphertext the implicit-rejection
    secret (no error)."""
    assert len(MLKEM[type_name]) == 2
    for case in MLKEM[type_name]:
        handle = load(type_name, bytes.fromhex(case["d"] + case["z"]))
        assert handle.public_key_raw() == case["pk"]
        pem = handle.public_key_pem()
        assert pem is not None
        public = serialization.load_pem_public_key(pem.encode())
        assert isinstance(public, mlkem.MLKEM768PublicKey | mlkem.MLKEM1024PublicKey)
        assert public.public_bytes_raw().hex() == case["pk"]
        assert handle.decapsulate(bytes.fromhex(case["ct"])).hex() == case["ss"]
        assert handle.decapsulate(bytes.fromhex(case["ct_n"])).hex() == case["ss_n"]


@pytest.mark.parametrize("type_name", KEM_TYPES)
def test_kem_encapsulates_and_refuses_wrong_lengths(type_name: str) -> None:
    handle = load(type_name, KEY_TYPES[type_name].generate())
    ciphertext, secret = handle.encapsulate()
    assert len(ciphertext) == ENC_SIZES[type_name]
    assert len(secret) == 32
    assert handle.decapsulate(ciphertext) == secret
    other = load(type_name, KEY_TYPES[type_name].generate())
    assert other.decapsulate(ciphertext) != secret  # implicit rejection: another secret
    for bad in (b"", ciphertext[:-1], ciphertext + b"\x00"):
        with pytest.raises(InvalidOptions, match=f"{ENC_SIZES[type_name]} bytes"):
            handle.decapsulate(bad)


def test_xwing_has_no_spki_but_its_raw_key() -> None:
    handle = load("x25519-ml-kem-768", KEY_TYPES["x25519-ml-kem-768"].generate())
    assert handle.public_key_pem() is None  # no SPKI; public_key_raw is the HPKE key
    assert len(bytes.fromhex(handle.public_key_raw() or "")) == 1216


@pytest.mark.parametrize("vector", HPKE, ids=lambda v: f"kem{v['kem_id']:04x}")
def test_kem_decapsulates_the_hpke_vectors_enc(vector: dict[str, Any]) -> None:
    """The vectors' enc decapsulates to their KEM shared_secret under skRm: FIPS 203 for
    ML-KEM, and cryptd's X-Wing combiner (service/crypto/xwing.py) for 0x647a."""
    _, type_name = KEMS[vector["kem_id"]]
    handle = load(type_name, bytes.fromhex(vector["skRm"]))
    assert handle.decapsulate(bytes.fromhex(vector["enc"])).hex() == vector["shared_secret"]


def test_xwing_encapsulates_and_refuses_bad_ciphertexts() -> None:
    handle = load("x25519-ml-kem-768", KEY_TYPES["x25519-ml-kem-768"].generate())
    ciphertext, secret = handle.encapsulate()
    assert len(ciphertext) == 1120
    assert handle.decapsulate(ciphertext) == secret
    assert handle.encapsulate()[1] != secret
    # Another X25519 part: another secret; a small-order one (here zero): refused.
    changed = ciphertext[:-1] + bytes([ciphertext[-1] ^ 1])
    assert handle.decapsulate(changed) != secret
    with pytest.raises(InvalidOptions, match="small order"):
        handle.decapsulate(ciphertext[:1088] + bytes(32))
    for bad in (ciphertext[:-1], ciphertext + b"\x00", ciphertext[:1088]):
        with pytest.raises(InvalidOptions, match="1120 bytes"):
            handle.decapsulate(bad)


@pytest.mark.parametrize("vector", HPKE, ids=lambda v: f"kem{v['kem_id']:04x}")
def test_hpke_pq_vectors(vector: dict[str, Any]) -> None:
    """draft-ietf-hpke-pq vectors: skRm (the seed cryptd stores) gives pkRm, and cryptd's
    private key opens the published ciphertexts under the vector's suite through the same
    pyca entry point cryptd seals and opens with."""
    kem, type_name = KEMS[vector["kem_id"]]
    handle = load(type_name, bytes.fromhex(vector["skRm"]))
    assert isinstance(handle, HpkeKey)
    assert handle.public_key_raw() == vector["pkRm"]
    assert len(bytes.fromhex(vector["enc"])) == ENC_SIZES[type_name] == kem.enc_length()
    suite = hpke.Suite(kem, KDFS[vector["kdf_id"]], AEADS[vector["aead_id"]])
    private = handle._private  # the vector's suite is not cryptd's: reach the key directly
    for encryption in vector["encryptions"][:1]:  # seq 0: the single-shot case
        body = bytes.fromhex(vector["enc"] + encryption["ct"])
        opened = cryptd_mlkem._open(
            suite, body, private, bytes.fromhex(vector["info"]), bytes.fromhex(encryption["aad"])
        )
        assert bytes(opened).hex() == encryption["pt"]


@pytest.mark.parametrize("type_name", KEM_TYPES)
def test_hpke_body_is_pycas_public_suite(type_name: str) -> None:
    """cryptd's HPKE (pyca's aad-taking entry point) is the public hpke.Suite when aad is empty:
    each opens the other's body."""
    handle = load(type_name, KEY_TYPES[type_name].generate())
    assert isinstance(handle, HpkeKey)
    suite = hpke.Suite(KEMS_BY_TYPE[type_name], hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
    body = handle.encrypt(b"plaintext", b"")
    assert len(body) == ENC_SIZES[type_name] + len(b"plaintext") + 16
    assert suite.decrypt(body, handle._private, info=b"") == b"plaintext"
    assert handle.decrypt(suite.encrypt(b"other", handle._public, info=b""), b"") == b"other"
    with_aad = handle.encrypt(b"plaintext", b"aad")
    with pytest.raises(Exception):  # noqa: B017, PT011 - pyca's own error; the aad is bound
        suite.decrypt(with_aad, handle._private, info=b"")


KEMS_BY_TYPE = {type_name: kem for kem, type_name in KEMS.values()}


@pytest.mark.parametrize("type_name", KEM_TYPES)
def test_hpke_tampered_bodies_fail_alike(type_name: str) -> None:
    handle = load(type_name, KEY_TYPES[type_name].generate())
    other = load(type_name, KEY_TYPES[type_name].generate())
    body = handle.encrypt(b"sixteen bytes!!!", b"aad")
    assert handle.decrypt(body, b"aad") == b"sixteen bytes!!!"
    enc = ENC_SIZES[type_name]
    damaged = [body[:n] for n in (0, 1, enc - 1, enc, enc + 15, len(body) - 1)]
    for index in (0, enc // 2, enc - 1, enc, len(body) - 17, len(body) - 1):
        damaged.append(body[:index] + bytes([body[index] ^ 0x01]) + body[index + 1 :])
    damaged.append(body + b"\x00")
    for bad in damaged:
        with pytest.raises(InvalidCiphertext):
            handle.decrypt(bad, b"aad")
    for aad in (b"", b"aae", b"aad\x00"):
        with pytest.raises(InvalidCiphertext):
            handle.decrypt(body, aad)
    with pytest.raises(InvalidCiphertext):
        other.decrypt(body, b"aad")


@pytest.mark.parametrize("type_name", KEM_TYPES)
def test_kem_seed_import_and_sizes(type_name: str) -> None:
    key_type = KEY_TYPES[type_name]
    import_key = key_type.import_key
    assert import_key is not None
    size = 32 if type_name == "x25519-ml-kem-768" else 64
    seed = key_type.generate()
    assert len(seed) == size
    assert import_key(seed) == seed
    assert load(type_name, seed).public_key_raw() == load(type_name, seed).public_key_raw()
    for wrong in (0, 16, size - 1, size + 1, 96):
        with pytest.raises(InvalidKeyMaterial):
            import_key(os.urandom(wrong))
        with pytest.raises(InvalidKeyMaterial):
            key_type.load(bytes(wrong))


def test_mlkem_import_takes_pkcs8_seed_form() -> None:
    import_key = KEY_TYPES["ml-kem-768"].import_key
    assert import_key is not None
    private = mlkem.MLKEM768PrivateKey.generate()
    der = private.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert import_key(der) == private.private_bytes_raw()
    handle = load("ml-kem-768", import_key(der))
    assert handle.public_key_raw() == private.public_key().public_bytes_raw().hex()
    with pytest.raises(InvalidKeyMaterial):
        KEY_TYPES["ml-kem-1024"].import_key(der)  # type: ignore[misc]


def test_handles_refuse_pickling() -> None:
    import pickle

    for type_name in (*MLDSA_TYPES, *KEM_TYPES):
        handle = load(type_name, KEY_TYPES[type_name].generate())
        assert isinstance(handle, MlDsaKey | HpkeKey)
        with pytest.raises(TypeError):
            pickle.dumps(handle)


def test_format_md_xwing_vector_opens() -> None:
    """docs/FORMAT.md's X-Wing token opens under its seed with its aad, and nothing else."""
    document = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    block = document.split("<!-- xwing-token -->\n```\n", 1)[1].split("\n```", 1)[0]
    text = "".join(block.split())
    prefix, version, encoded = text.split(":")
    assert (prefix, version) == ("cryptd", "v1")
    data = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    assert data[:2] == bytes([1, 19])
    handle = load("x25519-ml-kem-768", bytes(range(32)))
    assert (handle.public_key_raw() or "").startswith("6f54098a0a0e6411")
    assert handle.decrypt(data[2:], b"order:17") == b"post-quantum"
    with pytest.raises(InvalidCiphertext):
        handle.decrypt(data[2:], b"")
