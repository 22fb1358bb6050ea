"""Known-answer vectors for every non-SM2 primitive, run through cryptd's own classes.

Sources (each JSON file under tests/vectors names its origin):
- AES-256-GCM: McGrew-Viega GCM specification, test cases 13-16.
- SM4: GB/T 32907-2016 example 1 (block) and RFC 8998 Appendix A.1 (SM4-GCM).
- Ed25519: RFC 8032 section 7.1, TEST 1, 2, 3, 1024 and SHA(abc).
- RSA-OAEP, RSA-PSS, RSA PKCS#1 v1.5, ECDSA P-256 (DER and IEEE P1363): Wycheproof subsets.

Wycheproof semantics: every "valid" case must pass, every "invalid" case must fail, and a verify
never raises (any signature bytes that do not verify give False). "acceptable" cases are
legacy encodings a library may take or refuse: the tests only require a bool for them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service import operations
from service.crypto.aead import NONCE_SIZE, TAG_SIZE, AesGcm, Sm4Gcm
from service.crypto.base import InvalidCiphertext, KeyHandle, SignOptions
from service.crypto.ecdsa import EcdsaKey, der_to_raw
from service.crypto.registry import KEY_TYPES
from service.crypto.rsa import RsaKey
from service.errors import DecryptionFailed
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey

VECTORS = Path(__file__).parent / "vectors"
NO_OPTIONS = SignOptions()
PSS = SignOptions(algorithm="pss")
PKCS1 = SignOptions(algorithm="pkcs1v15")
DER = SignOptions(encoding="der")
RAW = SignOptions(encoding="raw")


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((VECTORS / name).read_text())
    return data


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def wycheproof_cases(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(group, test) pairs of a stored Wycheproof subset."""
    return [(group, test) for group in load(name)["testGroups"] for test in group["tests"]]


def case_id(case: tuple[dict[str, Any], dict[str, Any]]) -> str:
    test = case[1]
    return f"tc{test['tcId']}-{test['result']}"


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    changed = bytearray(data)
    changed[index] ^= mask
    return bytes(changed)


def handle_of(type_name: str, external: bytes) -> KeyHandle:
    """Import outside key material exactly as the service does, then parse it."""
    key_type = KEY_TYPES[type_name]
    assert key_type.import_key is not None
    return key_type.load(key_type.import_key(external))


# AES-256-GCM ----------------------------------------------------------------------------------

GCM = load("gcm_spec_aes256.json")["tests"]


@pytest.mark.parametrize("vector", GCM, ids=[f"tc{v['tcId']}" for v in GCM])
def test_aes256_gcm_spec_vector(vector: dict[str, str]) -> None:
    key, iv, aad, msg = h(vector["key"]), h(vector["iv"]), h(vector["aad"]), h(vector["msg"])
    sealed = h(vector["ct"]) + h(vector["tag"])
    # The vector itself, proven by an independent encryption with a fixed nonce.
    assert AESGCM(key).encrypt(iv, msg, aad) == sealed
    # Our AEAD opens nonce || ct || tag, and so does the key type's handle.
    assert AesGcm(key).open(iv + sealed, aad) == msg
    assert handle_of("aes256-gcm", key).decrypt(iv + sealed, aad) == msg
    # Any changed bit of the body or the associated data fails.
    for index in (0, NONCE_SIZE, len(iv + sealed) - 1):
        with pytest.raises(InvalidCiphertext):
            AesGcm(key).open(flip(iv + sealed, index), aad)
    with pytest.raises(InvalidCiphertext):
        AesGcm(key).open(iv + sealed, aad + b"\x00")


def test_aes256_gcm_seal_open_round_trip() -> None:
    key = bytes(range(32))
    aead = AesGcm(key)
    first, second = aead.seal(b"message", b"ad"), aead.seal(b"message", b"ad")
    assert first != second  # fresh random nonce per seal
    assert len(first) == NONCE_SIZE + len(b"message") + TAG_SIZE
    assert aead.open(first, b"ad") == b"message"
    # The layout is exactly nonce || ct || tag: pyca decrypts it split that way.
    assert AESGCM(key).decrypt(first[:NONCE_SIZE], first[NONCE_SIZE:], b"ad") == b"message"
    assert aead.open(aead.seal(b"", b""), b"") == b""


@pytest.mark.parametrize("size", [0, 1, NONCE_SIZE, NONCE_SIZE + TAG_SIZE - 1])
def test_aead_refuses_short_bodies(size: int) -> None:
    for aead in (AesGcm(bytes(32)), Sm4Gcm(bytes(16))):
        with pytest.raises(InvalidCiphertext):
            aead.open(bytes(size), b"")


# SM4 ------------------------------------------------------------------------------------------

SM4 = load("sm4_gbt32907_rfc8998.json")


def test_sm4_block_gbt32907_example() -> None:
    block = SM4["block"]
    # One block through the cipher cryptd's SM4-GCM is built on (ECB: a single-block KAT).
    cipher = Cipher(algorithms.SM4(h(block["key"])), modes.ECB())  # noqa: S305
    encryptor = cipher.encryptor()
    assert encryptor.update(h(block["plaintext"])) + encryptor.finalize() == h(block["ciphertext"])


def test_sm4_gcm_rfc8998_vector() -> None:
    vector = SM4["gcm"]
    key, iv, aad, msg = h(vector["key"]), h(vector["iv"]), h(vector["aad"]), h(vector["msg"])
    ct, tag = h(vector["ct"]), h(vector["tag"])
    # The vector itself, by a fixed-nonce encryption through the same pyca primitive.
    encryptor = Cipher(algorithms.SM4(key), modes.GCM(iv)).encryptor()
    encryptor.authenticate_additional_data(aad)
    assert encryptor.update(msg) + encryptor.finalize() == ct
    assert encryptor.tag == tag
    # Our Sm4Gcm and the sm4-gcm key type open nonce || ct || tag.
    assert Sm4Gcm(key).open(iv + ct + tag, aad) == msg
    assert handle_of("sm4-gcm", key).decrypt(iv + ct + tag, aad) == msg
    for index in (0, NONCE_SIZE, NONCE_SIZE + len(ct), NONCE_SIZE + len(ct) + TAG_SIZE - 1):
        with pytest.raises(InvalidCiphertext):
            Sm4Gcm(key).open(flip(iv + ct + tag, index), aad)
    with pytest.raises(InvalidCiphertext):
        Sm4Gcm(key).open(iv + ct + tag, aad[:-1])


def test_sm4_gcm_seal_open_round_trip() -> None:
    key = h(SM4["gcm"]["key"])
    aead = Sm4Gcm(key)
    body = aead.seal(b"sm4 message", b"ad")
    assert len(body) == NONCE_SIZE + len(b"sm4 message") + TAG_SIZE
    assert aead.open(body, b"ad") == b"sm4 message"
    # Layout check against pyca directly: nonce first, tag last.
    decryptor = Cipher(algorithms.SM4(key), modes.GCM(body[:NONCE_SIZE], body[-TAG_SIZE:]))
    opener = decryptor.decryptor()
    opener.authenticate_additional_data(b"ad")
    assert opener.update(body[NONCE_SIZE:-TAG_SIZE]) + opener.finalize() == b"sm4 message"


# Ed25519 --------------------------------------------------------------------------------------

ED25519 = load("rfc8032_ed25519.json")["tests"]


def ed25519_pkcs8_pem(seed: bytes) -> bytes:
    return ed25519.Ed25519PrivateKey.from_private_bytes(seed).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def test_ed25519_vectors_are_the_rfcs() -> None:
    names = [v["name"] for v in ED25519]
    assert names == ["TEST 1", "TEST 2", "TEST 3", "TEST 1024", "TEST SHA(abc)"]
    assert [len(h(v["msg"])) for v in ED25519] == [0, 1, 2, 1023, 64]
    assert h(ED25519[4]["msg"]) == hashlib.sha512(b"abc").digest()


@pytest.mark.parametrize("vector", ED25519, ids=[v["name"] for v in ED25519])
def test_ed25519_rfc8032_from_the_seed(vector: dict[str, str]) -> None:
    # The keyring's material is the raw seed: the handle the service signs with is this one.
    handle = KEY_TYPES["ed25519"].load(h(vector["secretKey"]))
    msg, sig = h(vector["msg"]), h(vector["sig"])
    assert handle.sign(msg, prehashed=False, options=NO_OPTIONS) == sig
    assert handle.verify(sig, msg, prehashed=False, options=NO_OPTIONS) is True
    public = ed25519.Ed25519PublicKey.from_public_bytes(h(vector["publicKey"]))
    public.verify(sig, msg)  # pyca/cryptography accepts it under the RFC's public key
    pem = handle.public_key_pem()
    assert pem is not None
    assert pem.encode() == public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@pytest.mark.parametrize("vector", ED25519, ids=[v["name"] for v in ED25519])
def test_ed25519_rfc8032(vector: dict[str, str]) -> None:
    handle = handle_of("ed25519", ed25519_pkcs8_pem(h(vector["secretKey"])))
    msg, sig = h(vector["msg"]), h(vector["sig"])
    # Deterministic: our signature is the published one, byte for byte.
    assert handle.sign(msg, prehashed=False, options=NO_OPTIONS) == sig
    assert handle.verify(sig, msg, prehashed=False, options=NO_OPTIONS) is True
    pem = handle.public_key_pem()
    assert pem is not None
    public = serialization.load_pem_public_key(pem.encode())
    assert isinstance(public, ed25519.Ed25519PublicKey)
    assert public.public_bytes_raw() == h(vector["publicKey"])
    # One flipped bit anywhere in the signature, or a changed message, fails (no exception).
    for index in (0, 31, 32, 63):
        assert handle.verify(flip(sig, index), msg, prehashed=False, options=NO_OPTIONS) is False
    assert handle.verify(sig, msg + b"\x00", prehashed=False, options=NO_OPTIONS) is False
    if msg:
        assert handle.verify(sig, flip(msg, 0), prehashed=False, options=NO_OPTIONS) is False
    for bad in (b"", sig[:-1], sig + b"\x00"):
        assert handle.verify(bad, msg, prehashed=False, options=NO_OPTIONS) is False


# RSA ------------------------------------------------------------------------------------------

OAEP_FILE = load("wycheproof_rsa_oaep_2048_sha256_mgf1sha256.json")
OAEP_GROUP = OAEP_FILE["testGroups"][0]


@pytest.fixture(scope="module")
def wycheproof_rsa() -> KeyHandle:
    """The 2048-bit Wycheproof key, imported as the service imports a private key."""
    return handle_of("rsa-2048", h(OAEP_GROUP["privateKeyPkcs8"]))


def test_wycheproof_rsa_key_is_the_signature_files_key(wycheproof_rsa: KeyHandle) -> None:
    """The PSS and PKCS#1 files publish only this key's public half: verify through the private
    key handle is justified because the moduli are identical."""
    pem = wycheproof_rsa.public_key_pem()
    assert pem is not None
    ours = serialization.load_pem_public_key(pem.encode())
    assert isinstance(ours, rsa.RSAPublicKey)
    for name in (
        "wycheproof_rsa_pss_2048_sha256_mgf1_32.json",
        "wycheproof_rsa_signature_2048_sha256.json",
    ):
        group = load(name)["testGroups"][0]
        theirs = serialization.load_der_public_key(h(group["keyDer"]))
        assert isinstance(theirs, rsa.RSAPublicKey)
        assert theirs.public_numbers() == ours.public_numbers()
        assert ours.public_numbers().n == int(group["n"], 16)


@pytest.mark.parametrize(
    "case",
    wycheproof_cases("wycheproof_rsa_oaep_2048_sha256_mgf1sha256.json"),
    ids=case_id,
)
def test_wycheproof_rsa_oaep_decrypt(
    wycheproof_rsa: KeyHandle, case: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    _, test = case
    assert test["label"] == ""  # cryptd's OAEP has no label
    if test["result"] == "valid":
        assert wycheproof_rsa.decrypt_external(h(test["ct"]), "rsa-oaep-sha256") == h(test["msg"])
    else:
        with pytest.raises(InvalidCiphertext):
            wycheproof_rsa.decrypt_external(h(test["ct"]), "rsa-oaep-sha256")


@pytest.mark.parametrize(
    "case", wycheproof_cases("wycheproof_rsa_pss_2048_sha256_mgf1_32.json"), ids=case_id
)
def test_wycheproof_rsa_pss_verify(
    wycheproof_rsa: KeyHandle, case: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    group, test = case
    assert (group["sha"], group["mgfSha"], group["sLen"]) == ("SHA-256", "SHA-256", 32)
    msg, sig = h(test["msg"]), h(test["sig"])
    expected = test["result"] == "valid"
    # PSS is the default algorithm: no option and "pss" must agree.
    for options in (NO_OPTIONS, PSS):
        assert wycheproof_rsa.verify(sig, msg, prehashed=False, options=options) is expected
    digest = hashlib.sha256(msg).digest()
    assert wycheproof_rsa.verify(sig, digest, prehashed=True, options=PSS) is expected


@pytest.mark.parametrize(
    "case", wycheproof_cases("wycheproof_rsa_signature_2048_sha256.json"), ids=case_id
)
def test_wycheproof_rsa_pkcs1v15_verify(
    wycheproof_rsa: KeyHandle, case: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    _, test = case
    msg, sig = h(test["msg"]), h(test["sig"])
    result = wycheproof_rsa.verify(sig, msg, prehashed=False, options=PKCS1)
    if test["result"] == "acceptable":
        # tcId 8, DigestInfo without the NULL parameter: refused by OpenSSL (observed False).
        assert isinstance(result, bool)
        return
    expected = test["result"] == "valid"
    assert result is expected
    digest = hashlib.sha256(msg).digest()
    assert wycheproof_rsa.verify(sig, digest, prehashed=True, options=PKCS1) is expected
    if expected:
        # PKCS#1 v1.5 is deterministic: our signature is the published one.
        assert wycheproof_rsa.sign(msg, prehashed=False, options=PKCS1) == sig
        assert wycheproof_rsa.sign(digest, prehashed=True, options=PKCS1) == sig
        # The same bytes are not a PSS signature.
        assert wycheproof_rsa.verify(sig, msg, prehashed=False, options=PSS) is False


def test_rsa_pss_sign_verifies_with_wycheproof_parameters(wycheproof_rsa: KeyHandle) -> None:
    """Our PSS signature (randomized) verifies under the vector files' parameters with pyca."""
    group = load("wycheproof_rsa_pss_2048_sha256_mgf1_32.json")["testGroups"][0]
    public = serialization.load_der_public_key(h(group["keyDer"]))
    assert isinstance(public, rsa.RSAPublicKey)
    signature = wycheproof_rsa.sign(b"cryptd", prehashed=False, options=NO_OPTIONS)
    public.verify(
        signature,
        b"cryptd",
        padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32),
        hashes.SHA256(),
    )


def test_wycheproof_rsa_oaep_through_engine(tmp_path: Path) -> None:
    """External OAEP ciphertext decrypts through the engine with an imported key."""
    master = MasterKey(bytes(range(32)))
    path = tmp_path / "keyring.json"
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master)
    manager.load()
    key_type = KEY_TYPES["rsa-2048"]
    assert key_type.import_key is not None
    manager.create("wp", "rsa-2048", material=key_type.import_key(h(OAEP_GROUP["privateKeyPkcs8"])))
    valid = [t for t in OAEP_GROUP["tests"] if t["result"] == "valid"][:3]
    invalid = [t for t in OAEP_GROUP["tests"] if t["result"] == "invalid"][:3]
    items = [
        operations.DecryptItem(ciphertext=operations.b64(h(t["ct"])), format="rsa-oaep-sha256")
        for t in valid + invalid
    ]
    results = operations.run_batch(manager.keyring, "decrypt", "wp", items)
    for test, result in zip(valid, results[: len(valid)], strict=True):
        assert result == {"plaintext": operations.b64(h(test["msg"])), "key_version": 1}
    for result in results[len(valid) :]:
        assert isinstance(result, DecryptionFailed)


# ECDSA P-256 ----------------------------------------------------------------------------------


# The curve's type name, scalar size and default hash, by pyca's curve name.
CURVES = {
    "secp256r1": ("ecdsa-p256", 32, "sha2-256"),
    "secp384r1": ("ecdsa-p384", 48, "sha2-384"),
    "secp521r1": ("ecdsa-p521", 66, "sha2-512"),
}


class PublicEcdsa(EcdsaKey):
    """EcdsaKey's own verify over a public key alone.

    The class is built from a private key; Wycheproof publishes public keys only. This adapter
    sets the attributes verify reads (the public key, the scalar size and the type's default
    hash), so the code under test (hash choice, encoding choice, raw -> DER, exception mapping)
    is the class's own.
    """

    def __init__(self, public: ec.EllipticCurvePublicKey) -> None:
        type_name, scalar, default_hash = CURVES[public.curve.name]
        self.type_name = type_name  # type: ignore[misc]
        self._public = public
        self._scalar = scalar
        self._default_hash = default_hash


def ecdsa_verifier(group: dict[str, Any]) -> PublicEcdsa:
    public = serialization.load_der_public_key(h(group["keyDer"]))
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert isinstance(public.curve, ec.SECP256R1)
    return PublicEcdsa(public)


@pytest.mark.parametrize(
    "case", wycheproof_cases("wycheproof_ecdsa_secp256r1_sha256.json"), ids=case_id
)
def test_wycheproof_ecdsa_p256_der_verify(case: tuple[dict[str, Any], dict[str, Any]]) -> None:
    group, test = case
    verifier = ecdsa_verifier(group)
    msg, sig = h(test["msg"]), h(test["sig"])
    results = {
        verifier.verify(sig, msg, prehashed=False, options=options) for options in (NO_OPTIONS, DER)
    }
    if test["result"] == "acceptable":
        # tcId 2, s without its leading zero: refused by OpenSSL's strict DER (observed False).
        assert results <= {True, False}
        return
    expected = test["result"] == "valid"
    assert results == {expected}
    digest = hashlib.sha256(msg).digest()
    assert verifier.verify(sig, digest, prehashed=True, options=DER) is expected
    if expected:
        # The same signature as fixed-length r || s verifies with encoding "raw".
        raw = der_to_raw(sig, 32)
        assert verifier.verify(raw, msg, prehashed=False, options=RAW) is True
        assert verifier.verify(sig, msg, prehashed=False, options=RAW) is False
        assert verifier.verify(sig, msg + b"x", prehashed=False, options=DER) is False


@pytest.mark.parametrize(
    "case", wycheproof_cases("wycheproof_ecdsa_secp256r1_sha256_p1363.json"), ids=case_id
)
def test_wycheproof_ecdsa_p256_raw_verify(case: tuple[dict[str, Any], dict[str, Any]]) -> None:
    group, test = case
    verifier = ecdsa_verifier(group)
    msg, sig = h(test["msg"]), h(test["sig"])
    expected = test["result"] == "valid"
    assert verifier.verify(sig, msg, prehashed=False, options=RAW) is expected
    digest = hashlib.sha256(msg).digest()
    assert verifier.verify(sig, digest, prehashed=True, options=RAW) is expected
    # r || s bytes are never a DER signature.
    assert verifier.verify(sig, msg, prehashed=False, options=NO_OPTIONS) is False
    if expected:
        assert verifier.verify(flip(sig, 63), msg, prehashed=False, options=RAW) is False
        assert verifier.verify(sig[:-1], msg, prehashed=False, options=RAW) is False


@pytest.fixture(scope="module")
def ecdsa_handle() -> KeyHandle:
    private = ec.generate_private_key(ec.SECP256R1())
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return handle_of("ecdsa-p256", pem)


def test_ecdsa_p256_sign_verify_both_encodings(ecdsa_handle: KeyHandle) -> None:
    pem = ecdsa_handle.public_key_pem()
    assert pem is not None
    public = serialization.load_pem_public_key(pem.encode())
    assert isinstance(public, ec.EllipticCurvePublicKey)
    der = ecdsa_handle.sign(b"msg", prehashed=False, options=NO_OPTIONS)
    raw = ecdsa_handle.sign(b"msg", prehashed=False, options=RAW)
    assert len(raw) == 64
    public.verify(der, b"msg", ec.ECDSA(hashes.SHA256()))  # independent check: standard DER
    assert ecdsa_handle.verify(der, b"msg", prehashed=False, options=DER) is True
    assert ecdsa_handle.verify(raw, b"msg", prehashed=False, options=RAW) is True
    digest = hashlib.sha256(b"msg").digest()
    by_digest = ecdsa_handle.sign(digest, prehashed=True, options=NO_OPTIONS)
    assert ecdsa_handle.verify(by_digest, b"msg", prehashed=False, options=NO_OPTIONS) is True
    for bad in (b"", b"\x30", raw[:-1], raw + b"\x00", bytes(64)):
        assert ecdsa_handle.verify(bad, b"msg", prehashed=False, options=RAW) is False
        assert ecdsa_handle.verify(bad, b"msg", prehashed=False, options=DER) is False


def test_rsa_handle_is_the_rsa_class(wycheproof_rsa: KeyHandle) -> None:
    assert isinstance(wycheproof_rsa, RsaKey)
    assert wycheproof_rsa.type_name == "rsa-2048"
