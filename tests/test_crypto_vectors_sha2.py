"""Known-answer vectors for ECDSA P-384 / P-521 and the SHA-384 / SHA-512 signatures
(``hash_algorithm``), run through cryptd's own key classes.

Sources: Wycheproof subsets (C2SP/wycheproof, testvectors_v1; each JSON file under tests/vectors
names its file, commit and the tests it keeps):
- ecdsa_secp384r1_sha384, ecdsa_secp521r1_sha512 (DER) and their _p1363 (r||s) files: the
  default hashes of ecdsa-p384 and ecdsa-p521;
- ecdsa_secp256r1_sha512, ecdsa_secp384r1_sha512: a hash other than the curve's default;
- rsa_pss_2048_sha384_mgf1_48, rsa_pss_4096_sha512_mgf1_64: RSA-PSS with MGF1 over the same
  hash and salt = digest length, cryptd's PSS parameters;
- rsa_signature_2048_sha384, rsa_signature_2048_sha512: RSA PKCS#1 v1.5.

Wycheproof semantics: every "valid" case must pass, every "invalid" case must fail, and verify
never raises (any signature bytes that do not verify give False); "acceptable" cases only need
a bool.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from service.crypto.base import InvalidOptions, KeyHandle, SignOptions
from service.crypto.ecdsa import der_to_raw
from service.crypto.registry import KEY_TYPES
from service.crypto.rsa import RsaKey
from tests.test_crypto_vectors import CURVES, PublicEcdsa

VECTORS = Path(__file__).parent / "vectors"
HASHLIB = {"SHA-256": hashlib.sha256, "SHA-384": hashlib.sha384, "SHA-512": hashlib.sha512}
NAMES = {"SHA-256": "sha2-256", "SHA-384": "sha2-384", "SHA-512": "sha2-512"}
PYCA = {"sha2-256": hashes.SHA256(), "sha2-384": hashes.SHA384(), "sha2-512": hashes.SHA512()}
Case = tuple[dict[str, Any], dict[str, Any]]


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def cases(name: str) -> list[Case]:
    data = json.loads((VECTORS / name).read_text())
    assert data["source"]["repository"] == "C2SP/wycheproof"
    return [(group, test) for group in data["testGroups"] for test in group["tests"]]


def case_id(case: Case) -> str:
    return f"tc{case[1]['tcId']}-{case[1]['result']}"


def parameters(files: list[str]) -> dict[str, Any]:
    """pytest.mark.parametrize arguments for ("name", "case") over every case of ``files``."""
    pairs = [(name, case) for name in files for case in cases(name)]
    return {
        "argnames": ("name", "case"),
        "argvalues": pairs,
        "ids": [f"{name[11:-5]}-{case_id(case)}" for name, case in pairs],
    }


def flip(data: bytes, index: int) -> bytes:
    changed = bytearray(data)
    changed[index] ^= 0x01
    return bytes(changed)


# ECDSA ----------------------------------------------------------------------------------------


def ecdsa_verifier(group: dict[str, Any]) -> PublicEcdsa:
    public = serialization.load_der_public_key(h(group["publicKeyDer"]))
    assert isinstance(public, ec.EllipticCurvePublicKey)
    return PublicEcdsa(public)


ECDSA_DER = [
    "wycheproof_ecdsa_secp384r1_sha384.json",
    "wycheproof_ecdsa_secp521r1_sha512.json",
    "wycheproof_ecdsa_secp256r1_sha512.json",
    "wycheproof_ecdsa_secp384r1_sha512.json",
]
ECDSA_P1363 = [
    "wycheproof_ecdsa_secp384r1_sha384_p1363.json",
    "wycheproof_ecdsa_secp521r1_sha512_p1363.json",
]


@pytest.mark.parametrize(**parameters(ECDSA_DER))
def test_wycheproof_ecdsa_der(name: str, case: Case) -> None:
    group, test = case
    verifier = ecdsa_verifier(group)
    hash_name = NAMES[group["sha"]]
    msg, sig = h(test["msg"]), h(test["sig"])
    chosen = SignOptions(hash_algorithm=hash_name)
    result = verifier.verify(sig, msg, prehashed=False, options=chosen)
    if test["result"] == "acceptable":
        assert isinstance(result, bool)
        return
    expected = test["result"] == "valid"
    assert result is expected
    digest = HASHLIB[group["sha"]](msg).digest()
    assert verifier.verify(sig, digest, prehashed=True, options=chosen) is expected
    is_default = hash_name == verifier._default_hash
    # Without hash_algorithm the type's default applies: the file's hash when it is the
    # curve's own, otherwise a valid signature must fail.
    default = verifier.verify(sig, msg, prehashed=False, options=SignOptions())
    assert default is (expected and is_default)
    if expected:
        raw = der_to_raw(sig, verifier._scalar)
        raw_options = SignOptions(encoding="raw", hash_algorithm=hash_name)
        assert verifier.verify(raw, msg, prehashed=False, options=raw_options) is True
        assert verifier.verify(sig, msg, prehashed=False, options=raw_options) is False
        assert verifier.verify(sig, msg + b"x", prehashed=False, options=chosen) is False


@pytest.mark.parametrize(**parameters(ECDSA_P1363))
def test_wycheproof_ecdsa_p1363(name: str, case: Case) -> None:
    group, test = case
    verifier = ecdsa_verifier(group)
    assert NAMES[group["sha"]] == verifier._default_hash
    msg, sig = h(test["msg"]), h(test["sig"])
    expected = test["result"] == "valid"
    raw = SignOptions(encoding="raw")
    assert verifier.verify(sig, msg, prehashed=False, options=raw) is expected
    digest = HASHLIB[group["sha"]](msg).digest()
    assert verifier.verify(sig, digest, prehashed=True, options=raw) is expected
    # r || s bytes are never a DER signature.
    assert verifier.verify(sig, msg, prehashed=False, options=SignOptions()) is False
    if expected:
        assert verifier.verify(flip(sig, len(sig) - 1), msg, prehashed=False, options=raw) is False
        assert verifier.verify(sig[:-1], msg, prehashed=False, options=raw) is False


def generated(type_name: str) -> KeyHandle:
    key_type = KEY_TYPES[type_name]
    assert key_type.import_key is not None
    material = key_type.generate()
    if type_name != "ed25519":  # its material is the raw seed, its import takes PKCS#8
        # The import path (full validation) accepts what generate makes.
        assert key_type.import_key(material) == material
    return key_type.load(material)


@pytest.mark.parametrize("type_name", ["ecdsa-p256", "ecdsa-p384", "ecdsa-p521"])
def test_ecdsa_sign_with_every_hash_verifies_with_pyca(type_name: str) -> None:
    handle = generated(type_name)
    pem = handle.public_key_pem()
    assert pem is not None
    public = serialization.load_pem_public_key(pem.encode())
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert CURVES[public.curve.name][0] == type_name
    _, scalar, default_hash = CURVES[public.curve.name]
    assert KEY_TYPES[type_name].sign_digest_size == PYCA[default_hash].digest_size
    for hash_name, algorithm in PYCA.items():
        options = SignOptions(hash_algorithm=hash_name)
        signature = handle.sign(b"message", prehashed=False, options=options)
        public.verify(signature, b"message", ec.ECDSA(algorithm))  # independent check
        assert handle.verify(signature, b"message", prehashed=False, options=options) is True
        raw = handle.sign(
            b"message",
            prehashed=False,
            options=SignOptions(encoding="raw", hash_algorithm=hash_name),
        )
        assert len(raw) == 2 * scalar
        digest = hashes.Hash(algorithm)
        digest.update(b"message")
        by_digest = handle.sign(digest.finalize(), prehashed=True, options=options)
        assert handle.verify(by_digest, b"message", prehashed=False, options=options) is True
        same_hash = hash_name == default_hash
        assert handle.verify(signature, b"message", prehashed=False, options=SignOptions()) is (
            same_hash
        )
    default = handle.sign(b"message", prehashed=False, options=SignOptions())
    public.verify(default, b"message", ec.ECDSA(PYCA[default_hash]))


@pytest.mark.parametrize("type_name", ["ecdsa-p384", "ecdsa-p521", "rsa-2048"])
def test_digest_length_follows_the_hash(type_name: str) -> None:
    handle = generated(type_name)
    for hash_name, algorithm in PYCA.items():
        options = SignOptions(hash_algorithm=hash_name)
        for wrong in (algorithm.digest_size - 1, algorithm.digest_size + 1, 0):
            with pytest.raises(InvalidOptions, match=f"digest must be {algorithm.digest_size}"):
                handle.sign(bytes(wrong), prehashed=True, options=options)
            with pytest.raises(InvalidOptions):
                handle.verify(b"sig", bytes(wrong), prehashed=True, options=options)


@pytest.mark.parametrize("type_name", ["ecdsa-p384", "rsa-2048", "ed25519"])
@pytest.mark.parametrize("bad", ["sha1", "md5", "sha3-256", "SHA2-256", "sha256", ""])
def test_unknown_hash_algorithm_is_refused(type_name: str, bad: str) -> None:
    handle = generated(type_name)
    options = SignOptions(hash_algorithm=bad)
    with pytest.raises(InvalidOptions):
        handle.sign(b"m", prehashed=False, options=options)
    with pytest.raises(InvalidOptions):
        handle.verify(b"s", b"m", prehashed=False, options=options)


def test_ed25519_refuses_every_hash_algorithm() -> None:
    handle = generated("ed25519")
    for name in PYCA:
        with pytest.raises(InvalidOptions, match="hash_algorithm"):
            handle.sign(b"m", prehashed=False, options=SignOptions(hash_algorithm=name))


def test_ecdsa_import_refuses_another_curve() -> None:
    p256 = KEY_TYPES["ecdsa-p256"].generate()
    for type_name in ("ecdsa-p384", "ecdsa-p521"):
        import_key = KEY_TYPES[type_name].import_key
        assert import_key is not None
        with pytest.raises(Exception, match="private key"):
            import_key(p256)


# RSA ------------------------------------------------------------------------------------------


class PublicRsa(RsaKey):
    """RsaKey's own verify over a Wycheproof public key (the adapter sets the public key)."""

    def __init__(self, public: rsa.RSAPublicKey) -> None:
        self.type_name = f"rsa-{public.key_size}"  # type: ignore[misc]
        self._public = public


def rsa_verifier(group: dict[str, Any]) -> PublicRsa:
    public = serialization.load_der_public_key(h(group["publicKeyDer"]))
    assert isinstance(public, rsa.RSAPublicKey)
    assert public.key_size == group["keySize"]
    return PublicRsa(public)


PSS_FILES = [
    "wycheproof_rsa_pss_2048_sha384_mgf1_48.json",
    "wycheproof_rsa_pss_4096_sha512_mgf1_64.json",
]
PKCS1_FILES = [
    "wycheproof_rsa_signature_2048_sha384.json",
    "wycheproof_rsa_signature_2048_sha512.json",
]


@pytest.mark.parametrize(**parameters(PSS_FILES))
def test_wycheproof_rsa_pss_sha2(name: str, case: Case) -> None:
    group, test = case
    # cryptd's PSS: MGF1 over the signature's hash, salt = digest length.
    assert group["mgfSha"] == group["sha"]
    assert group["sLen"] == HASHLIB[group["sha"]]().digest_size
    verifier = rsa_verifier(group)
    hash_name = NAMES[group["sha"]]
    msg, sig = h(test["msg"]), h(test["sig"])
    expected = test["result"] == "valid"
    for options in (
        SignOptions(hash_algorithm=hash_name),
        SignOptions(algorithm="pss", hash_algorithm=hash_name),
    ):
        assert verifier.verify(sig, msg, prehashed=False, options=options) is expected
    digest = HASHLIB[group["sha"]](msg).digest()
    options = SignOptions(hash_algorithm=hash_name)
    assert verifier.verify(sig, digest, prehashed=True, options=options) is expected
    # SHA-256, the default, is another scheme: a valid SHA-384/512 signature fails under it.
    assert verifier.verify(sig, msg, prehashed=False, options=SignOptions()) is False


@pytest.mark.parametrize(**parameters(PKCS1_FILES))
def test_wycheproof_rsa_pkcs1v15_sha2(name: str, case: Case) -> None:
    group, test = case
    verifier = rsa_verifier(group)
    hash_name = NAMES[group["sha"]]
    msg, sig = h(test["msg"]), h(test["sig"])
    options = SignOptions(algorithm="pkcs1v15", hash_algorithm=hash_name)
    result = verifier.verify(sig, msg, prehashed=False, options=options)
    if test["result"] == "acceptable":
        assert isinstance(result, bool)
        return
    expected = test["result"] == "valid"
    assert result is expected
    digest = HASHLIB[group["sha"]](msg).digest()
    assert verifier.verify(sig, digest, prehashed=True, options=options) is expected
    if expected:
        other = SignOptions(algorithm="pkcs1v15")
        assert verifier.verify(sig, msg, prehashed=False, options=other) is False
        pss = SignOptions(hash_algorithm=hash_name)
        assert verifier.verify(sig, msg, prehashed=False, options=pss) is False


@pytest.fixture(scope="module")
def rsa_2048() -> KeyHandle:
    return generated("rsa-2048")


@pytest.mark.parametrize("hash_name", list(PYCA))
def test_rsa_sign_with_every_hash_verifies_with_pyca(rsa_2048: KeyHandle, hash_name: str) -> None:
    pem = rsa_2048.public_key_pem()
    assert pem is not None
    public = serialization.load_pem_public_key(pem.encode())
    assert isinstance(public, rsa.RSAPublicKey)
    algorithm = PYCA[hash_name]
    options = SignOptions(hash_algorithm=hash_name)
    pss = rsa_2048.sign(b"message", prehashed=False, options=options)
    public.verify(
        pss,
        b"message",
        padding.PSS(mgf=padding.MGF1(algorithm), salt_length=algorithm.digest_size),
        algorithm,
    )
    pkcs1_options = SignOptions(algorithm="pkcs1v15", hash_algorithm=hash_name)
    pkcs1 = rsa_2048.sign(b"message", prehashed=False, options=pkcs1_options)
    public.verify(pkcs1, b"message", padding.PKCS1v15(), algorithm)
    digest = hashes.Hash(algorithm)
    digest.update(b"message")
    # PKCS#1 v1.5 is deterministic: signing the digest gives the same bytes.
    assert rsa_2048.sign(digest.finalize(), prehashed=True, options=pkcs1_options) == pkcs1
    assert rsa_2048.verify(pss, b"message", prehashed=False, options=options) is True
    assert rsa_2048.verify(pss, b"other", prehashed=False, options=options) is False
