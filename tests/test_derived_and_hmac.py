"""HMAC tags, derived and convergent keys: docs/FORMAT.md sections 7 and 8, checked in both
directions, and the engine's behaviour (errors, determinism, tamper) over a real keyring.

Each documented vector is rebuilt here from the description alone with pyca/cryptography and
the standard library's hmac, then produced or decrypted by cryptd's engine from a keyring holding
the documented material. The vectors live in tests/vectors/derived_vectors.json and the document
must show exactly those values.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import hmac as pyca_hmac
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from service import operations
from service.crypto.registry import KEY_TYPES
from service.errors import CryptdError, DecryptionFailed, InvalidRequest, KeyNotFound
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.store import KeystoreError
from tests.test_token import new_manager

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "FORMAT.md").read_text()
VECTORS: dict[str, Any] = json.loads(
    (ROOT / "tests" / "vectors" / "derived_vectors.json").read_text()
)


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# The format, from docs/FORMAT.md only ----------------------------------------------------------


def doc_ad(name: str, version: int, type_id: int, aad: bytes) -> bytes:
    encoded = name.encode()
    return b"cryptd/1" + struct.pack(">BBI", type_id, len(encoded), version) + encoded + aad


def doc_info(purpose: int, type_id: int, name: str, version: int, context: bytes) -> bytes:
    encoded = name.encode()
    return (
        b"cryptd/derive/1"
        + bytes([purpose, type_id, len(encoded)])
        + version.to_bytes(4, "big")
        + encoded
        + context
    )


def doc_token(version: int, type_id: int, body: bytes) -> str:
    data = bytes([1, type_id]) + body
    return f"cryptd:v{version}:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def doc_hash(type_id: int) -> hashes.HashAlgorithm:
    return hashes.SM3() if type_id == 2 else hashes.SHA256()


def doc_seal(type_id: int, key: bytes, nonce: bytes, plaintext: bytes, ad: bytes) -> bytes:
    if type_id == 1:
        return nonce + AESGCM(key).encrypt(nonce, plaintext, ad)
    encryptor = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(ad)
    ciphertext = encryptor.update(plaintext) + encryptor.finalize()
    return nonce + ciphertext + encryptor.tag


def doc_convergent_nonce(type_id: int, nonce_key: bytes, ad: bytes, plaintext: bytes) -> bytes:
    mac = pyca_hmac.HMAC(nonce_key, doc_hash(type_id))
    mac.update(struct.pack(">I", len(ad)) + ad + plaintext)
    return mac.finalize()[:12]


def test_hmac_vector_is_python_hmac_and_shown() -> None:
    vector = VECTORS["hmac-sha256"]
    tag = hmac.new(h(vector["key"]), h(vector["message"]), hashlib.sha256).digest()
    assert tag == h(vector["tag"])
    text = f"cryptd:v{vector['version']}:" + base64.urlsafe_b64encode(tag).rstrip(b"=").decode()
    assert text == vector["mac"]
    section = DOC.split("## 7. HMAC tags", 1)[1].split("## 8.", 1)[0]
    for value in (vector["key"], vector["message"], vector["tag"], vector["mac"]):
        assert value in section
    recipe = section.split("```python", 1)[1].split("```", 1)[0]
    exec(compile(recipe, "FORMAT.md", "exec"), {})  # noqa: S102 - our own document


@pytest.mark.parametrize(
    "name", ["derived-aes256-gcm", "convergent-aes256-gcm", "convergent-sm4-gcm"]
)
def test_derived_vectors_are_rebuilt_from_the_document(name: str) -> None:
    v = VECTORS[name]
    type_id, material, context = v["type_id"], h(v["material"]), h(v["context"])
    size = len(material)
    key_info = doc_info(1, type_id, v["name"], v["version"], context)
    assert key_info == h(v.get("info") or v["key_info"])
    key = HKDF(doc_hash(type_id), size, None, key_info).derive(material)
    assert key == h(v["derived_key"])
    ad = doc_ad(v["name"], v["version"], type_id, h(v["aad"]))
    assert ad == h(v["associated_data"])
    if "nonce_key" in v:
        nonce_info = doc_info(2, type_id, v["name"], v["version"], context)
        assert nonce_info == h(v["nonce_info"])
        nonce_key = HKDF(doc_hash(type_id), 32, None, nonce_info).derive(material)
        assert nonce_key == h(v["nonce_key"])
        assert doc_convergent_nonce(type_id, nonce_key, ad, h(v["plaintext"])) == h(v["nonce"])
    body = doc_seal(type_id, key, h(v["nonce"]), h(v["plaintext"]), ad)
    assert doc_token(v["version"], type_id, body) == v["token"]
    section = DOC.split("## 8. Derived and convergent keys", 1)[1]
    for field in ("context", "derived_key", "plaintext", "nonce", "token"):
        assert v[field] in section, field
    if "nonce_key" in v:
        assert v["nonce_key"] in section


# A keyring holding the documented material -----------------------------------------------------


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> KeyManager:
    manager = new_manager(tmp_path_factory.mktemp("derived"))
    hv = VECTORS["hmac-sha256"]
    manager.create(hv["name"], "hmac-sha256")
    manager.rotate(hv["name"])
    manager.rotate(hv["name"], material=h(hv["key"]))
    for name in ("derived-aes256-gcm", "convergent-aes256-gcm", "convergent-sm4-gcm"):
        v = VECTORS[name]
        manager.create(
            v["name"],
            v["type"],
            material=h(v["material"]),
            derived=True,
            convergent="nonce_key" in v,
        )
    manager.create("plain-aes", "aes256-gcm")
    manager.create("plain-hmac", "hmac-sha512")
    manager.create("d-aes", "aes256-gcm", derived=True)
    manager.create("c-aes", "aes256-gcm", derived=True, convergent=True)
    manager.create("c-sm4", "sm4-gcm", derived=True, convergent=True)
    manager.create("d-hmac", "hmac-sm3", derived=True)
    manager.create("sig-p384", "ecdsa-p384")
    return manager


def one(
    manager: KeyManager, op: operations.OpName, name: str, item: operations.Item
) -> operations.Outcome:
    (outcome,) = operations.run_batch(manager.keyring, op, name, [item])
    return outcome


def ok(outcome: operations.Outcome) -> dict[str, Any]:
    assert isinstance(outcome, dict), repr(outcome)
    return outcome


def error(outcome: operations.Outcome, kind: type[CryptdError], text: str = "") -> None:
    assert isinstance(outcome, kind), repr(outcome)
    assert text in outcome.message


def keyring_file(manager: KeyManager) -> Path:
    """The file the keyring of a manager made on a file store is kept in."""
    store = manager.store
    assert isinstance(store, FileKeyStore)
    return store.path


def test_engine_mac_is_the_documented_tag(manager: KeyManager) -> None:
    hv = VECTORS["hmac-sha256"]
    result = ok(one(manager, "hmac", hv["name"], operations.HmacItem(h(hv["message"]))))
    assert result == {"mac": hv["mac"], "key_version": 3}
    verified = one(
        manager, "verify", hv["name"], operations.MacVerifyItem(hv["mac"], h(hv["message"]))
    )
    assert ok(verified) == {"valid": True}


@pytest.mark.parametrize("name", ["convergent-aes256-gcm", "convergent-sm4-gcm"])
def test_engine_convergent_token_is_the_documented_one(manager: KeyManager, name: str) -> None:
    v = VECTORS[name]
    item = operations.EncryptItem(h(v["plaintext"]), h(v["aad"]), context=h(v["context"]))
    assert ok(one(manager, "encrypt", v["name"], item))["ciphertext"] == v["token"]


@pytest.mark.parametrize(
    "name", ["derived-aes256-gcm", "convergent-aes256-gcm", "convergent-sm4-gcm"]
)
def test_engine_decrypts_the_documented_tokens(manager: KeyManager, name: str) -> None:
    v = VECTORS[name]
    item = operations.DecryptItem(v["token"], h(v["aad"]), context=h(v["context"]))
    assert ok(one(manager, "decrypt", v["name"], item))["plaintext"] == b64(h(v["plaintext"]))
    other = operations.DecryptItem(v["token"], h(v["aad"]), context=h(v["context"]) + b"x")
    error(one(manager, "decrypt", v["name"], other), DecryptionFailed)


# HMAC through the engine -----------------------------------------------------------------------


def test_hmac_rotation_versions_and_min_version(tmp_path: Path) -> None:
    manager = new_manager(tmp_path)
    manager.create("h", "hmac-sha256")
    first = ok(one(manager, "hmac", "h", operations.HmacItem(b"m")))
    assert first["mac"].startswith("cryptd:v1:")
    manager.rotate("h")
    second = ok(one(manager, "hmac", "h", operations.HmacItem(b"m")))
    assert second["key_version"] == 2
    assert second["mac"] != first["mac"]
    pinned = ok(one(manager, "hmac", "h", operations.HmacItem(b"m", key_version=1)))
    assert pinned == first  # HMAC is deterministic
    for mac in (first["mac"], second["mac"]):
        assert ok(one(manager, "verify", "h", operations.MacVerifyItem(mac, b"m"))) == {
            "valid": True
        }
    # A v1 tag relabelled v2 does not verify.
    relabelled = first["mac"].replace("cryptd:v1:", "cryptd:v2:")
    assert (
        ok(one(manager, "verify", "h", operations.MacVerifyItem(relabelled, b"m")))["valid"]
        is False
    )
    mismatch = operations.MacVerifyItem(first["mac"], b"m", key_version=2)
    error(one(manager, "verify", "h", mismatch), InvalidRequest, "key_version does not match")
    manager.update("h", min_decryption_version=2)
    error(
        one(manager, "verify", "h", operations.MacVerifyItem(first["mac"], b"m")),
        InvalidRequest,
        "below min_decryption_version",
    )
    error(one(manager, "hmac", "h", operations.HmacItem(b"m", key_version=1)), InvalidRequest)
    future = first["mac"].replace("cryptd:v1:", "cryptd:v9:")
    error(one(manager, "verify", "h", operations.MacVerifyItem(future, b"m")), KeyNotFound)


def test_hmac_verify_tamper_is_false_never_an_error(manager: KeyManager) -> None:
    mac: str = ok(one(manager, "hmac", "plain-hmac", operations.HmacItem(b"message")))["mac"]
    prefix, text = mac.rsplit(":", 1)
    tag = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    assert len(tag) == 64

    def verify(candidate: str, message: bytes = b"message") -> bool:
        result = ok(
            one(manager, "verify", "plain-hmac", operations.MacVerifyItem(candidate, message))
        )
        return bool(result["valid"])

    def spell(data: bytes) -> str:
        return prefix + ":" + base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    assert verify(mac) is True
    assert verify(mac, b"messagf") is False
    for index in range(len(tag)):
        changed = bytearray(tag)
        changed[index] ^= 0x80
        assert verify(spell(bytes(changed))) is False
    for other in (tag[:32], tag[:-1], tag + b"\x00", bytes(64)):
        assert verify(spell(other)) is False
    # Non-canonical base64url of the right tag (a set unused bit) is not the MAC either.
    last = text[-1]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    noncanonical = prefix + ":" + text[:-1] + alphabet[alphabet.index(last) ^ 1]
    assert verify(noncanonical) is False
    # Another key's MAC of the same message.
    other = ok(one(manager, "hmac", "d-hmac", operations.HmacItem(b"message", context=b"t")))["mac"]
    assert verify(other) is False


@pytest.mark.parametrize(
    ("mac", "message"),
    [
        ("", "not a cryptd MAC"),
        ("cryptd:v1:", "not a cryptd MAC"),
        ("cryptd:v0:AAAA", "not a cryptd MAC"),
        ("vault:v1:AAAA", "not a cryptd MAC"),
        ("cryptd:v1:AA+A", "not a cryptd MAC"),
    ],
)
def test_malformed_mac_text_is_invalid_request(manager: KeyManager, mac: str, message: str) -> None:
    error(
        one(manager, "verify", "plain-hmac", operations.MacVerifyItem(mac, b"m")),
        InvalidRequest,
        message,
    )


def test_hmac_and_signature_fields_do_not_mix(manager: KeyManager) -> None:
    error(
        one(manager, "verify", "plain-hmac", operations.VerifyItem(b"sig", b"m")),
        InvalidRequest,
        "verifies a 'mac'",
    )
    error(
        one(manager, "verify", "sig-p384", operations.MacVerifyItem("cryptd:v1:AAAA", b"m")),
        InvalidRequest,
        "'mac' applies to HMAC keys",
    )
    for op, item in (
        ("encrypt", operations.EncryptItem(b"m")),
        ("sign", operations.SignItem(b"m")),
        ("datakey", operations.DatakeyItem()),
    ):
        with pytest.raises(InvalidRequest, match="does not support"):
            operations.run_batch(manager.keyring, op, "plain-hmac", [item])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="does not support hmac"):
        operations.run_batch(manager.keyring, "hmac", "plain-aes", [operations.HmacItem(b"m")])


# Derived keys ----------------------------------------------------------------------------------


def encrypt(manager: KeyManager, name: str, plaintext: bytes, **fields: Any) -> str:
    ciphertext = ok(one(manager, "encrypt", name, operations.EncryptItem(plaintext, **fields)))
    return str(ciphertext["ciphertext"])


def test_context_rules(manager: KeyManager) -> None:
    error(
        one(manager, "encrypt", "plain-aes", operations.EncryptItem(b"m", context=b"t")),
        InvalidRequest,
        "'context' applies to derived keys only",
    )
    error(
        one(manager, "hmac", "plain-hmac", operations.HmacItem(b"m", context=b"t")),
        InvalidRequest,
        "'context' applies to derived keys only",
    )
    for name in ("d-aes", "c-aes"):
        error(
            one(manager, "encrypt", name, operations.EncryptItem(b"m")),
            InvalidRequest,
            "needs a 'context'",
        )
        error(
            one(manager, "encrypt", name, operations.EncryptItem(b"m", context=b"")),
            InvalidRequest,
            "must not be empty",
        )
        error(
            one(manager, "encrypt", name, operations.EncryptItem(b"m", context=b"x" * 1025)),
            InvalidRequest,
            "at most 1024 bytes",
        )
    token = encrypt(manager, "d-aes", b"m", context=b"x" * 1024)
    plain = encrypt(manager, "plain-aes", b"m")
    error(
        one(manager, "decrypt", "d-aes", operations.DecryptItem(token)), InvalidRequest, "'context'"
    )
    error(
        one(manager, "decrypt", "plain-aes", operations.DecryptItem(plain, context=b"t")),
        InvalidRequest,
        "derived keys only",
    )
    error(one(manager, "hmac", "d-hmac", operations.HmacItem(b"m")), InvalidRequest, "'context'")


def test_each_context_has_its_own_key(manager: KeyManager) -> None:
    a = encrypt(manager, "d-aes", b"secret", context=b"tenant-a")
    b = encrypt(manager, "d-aes", b"secret", context=b"tenant-b")
    assert a != b
    ok_a = ok(one(manager, "decrypt", "d-aes", operations.DecryptItem(a, context=b"tenant-a")))
    assert ok_a == {"plaintext": b64(b"secret"), "key_version": 1}
    for context in (b"tenant-b", b"tenant-a\x00", b"tenant-", b"Tenant-a"):
        error(
            one(manager, "decrypt", "d-aes", operations.DecryptItem(a, context=context)),
            DecryptionFailed,
        )
    # Random nonces: two encryptions of one plaintext in one context differ.
    assert encrypt(manager, "d-aes", b"secret", context=b"tenant-a") != a
    tag_a = ok(one(manager, "hmac", "d-hmac", operations.HmacItem(b"m", context=b"tenant-a")))[
        "mac"
    ]
    tag_b = ok(one(manager, "hmac", "d-hmac", operations.HmacItem(b"m", context=b"tenant-b")))[
        "mac"
    ]
    assert tag_a != tag_b
    check = operations.MacVerifyItem(tag_a, b"m", context=b"tenant-b")
    assert ok(one(manager, "verify", "d-hmac", check)) == {"valid": False}
    check = operations.MacVerifyItem(tag_a, b"m", context=b"tenant-a")
    assert ok(one(manager, "verify", "d-hmac", check)) == {"valid": True}


@pytest.mark.parametrize("name", ["c-aes", "c-sm4"])
def test_convergent_is_deterministic_per_context_aad_and_version(tmp_path: Path, name: str) -> None:
    manager = new_manager(tmp_path)
    manager.create(
        name, "aes256-gcm" if name == "c-aes" else "sm4-gcm", derived=True, convergent=True
    )
    first = encrypt(manager, name, b"4111111111111111", context=b"cards")
    assert encrypt(manager, name, b"4111111111111111", context=b"cards") == first
    others = {
        encrypt(manager, name, b"4111111111111112", context=b"cards"),
        encrypt(manager, name, b"4111111111111111", context=b"cards-2"),
        encrypt(manager, name, b"4111111111111111", context=b"cards", aad=b"col"),
        encrypt(manager, name, b"", context=b"cards"),
    }
    assert first not in others
    assert len(others) == 4
    # The nonces differ too (not only the ciphertext): no nonce reuse across inputs.
    nonces = {base64.urlsafe_b64decode(t.split(":")[2] + "==")[2:14] for t in {first, *others}}
    assert len(nonces) == 5
    manager.rotate(name)
    rotated = encrypt(manager, name, b"4111111111111111", context=b"cards")
    assert rotated != first
    assert rotated.startswith("cryptd:v2:")
    old = ok(one(manager, "decrypt", name, operations.DecryptItem(first, context=b"cards")))
    assert base64.b64decode(old["plaintext"]) == b"4111111111111111"


def flipped_tokens(token: str) -> list[str]:
    prefix, text = token.rsplit(":", 1)
    data = bytearray(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    out = []
    for index in range(len(data)):
        data[index] ^= 0x01
        out.append(prefix + ":" + base64.urlsafe_b64encode(bytes(data)).rstrip(b"=").decode())
        data[index] ^= 0x01
    return out


@pytest.mark.parametrize("name", ["d-aes", "c-aes", "c-sm4"])
def test_every_damaged_derived_token_fails_alike(manager: KeyManager, name: str) -> None:
    token = encrypt(manager, name, b"tamper me", context=b"t", aad=b"a")
    items = [operations.DecryptItem(t, b"a", context=b"t") for t in flipped_tokens(token)]
    items += [
        operations.DecryptItem(token, b"b", context=b"t"),
        operations.DecryptItem(token, b"", context=b"t"),
        operations.DecryptItem(token[:-2], b"a", context=b"t"),
    ]
    outcomes = operations.run_batch(manager.keyring, "decrypt", name, items)
    messages = set()
    for outcome in outcomes:
        assert isinstance(outcome, DecryptionFailed), outcome
        messages.add(outcome.message)
    assert messages == {"decryption failed"}
    # The token under another derived key, and under a key of the same type that is not derived.
    other = "c-aes" if name == "d-aes" else "d-aes"
    wrong = one(manager, "decrypt", other, operations.DecryptItem(token, b"a", context=b"t"))
    assert isinstance(wrong, DecryptionFailed)
    if name != "c-sm4":
        plain = one(manager, "decrypt", "plain-aes", operations.DecryptItem(token, b"a"))
        assert isinstance(plain, DecryptionFailed)


@pytest.mark.parametrize("name", ["c-aes", "c-sm4"])
def test_convergent_refuses_a_token_whose_nonce_is_not_the_computed_one(
    manager: KeyManager, name: str
) -> None:
    """A token that authenticates under the context's key but was made with another nonce (as a
    random-nonce encryption would be) is refused: one plaintext, one token."""
    handle = manager.keyring.key(name).version().handle.for_context(b"t")
    ad = doc_ad(name, 1, KEY_TYPES[manager.keyring.key(name).type.name].type_id, b"")
    aead: Any = handle._aead  # type: ignore[attr-defined]
    body = aead.seal(b"plaintext", ad)  # random nonce, valid tag
    assert aead.open(body, ad) == b"plaintext"
    token = doc_token(1, KEY_TYPES[manager.keyring.key(name).type.name].type_id, body)
    error(
        one(manager, "decrypt", name, operations.DecryptItem(token, context=b"t")), DecryptionFailed
    )
    good = encrypt(manager, name, b"plaintext", context=b"t")
    assert ok(one(manager, "decrypt", name, operations.DecryptItem(good, context=b"t")))


def test_rewrap_and_datakey_with_contexts(manager: KeyManager) -> None:
    token = encrypt(manager, "d-aes", b"move me", context=b"t1", aad=b"a")
    # derived -> plain: the context opens the source only.
    moved = ok(
        one(
            manager,
            "rewrap",
            "d-aes",
            operations.RewrapItem(token, b"a", "plain-aes", context=b"t1"),
        )
    )
    back = ok(
        one(manager, "decrypt", "plain-aes", operations.DecryptItem(moved["ciphertext"], b"a"))
    )
    assert base64.b64decode(back["plaintext"]) == b"move me"
    # plain -> convergent: the context seals the target.
    again = ok(
        one(
            manager,
            "rewrap",
            "plain-aes",
            operations.RewrapItem(moved["ciphertext"], b"a", "c-aes", b"t2"),
        )
    )
    assert again["ciphertext"] == encrypt(manager, "c-aes", b"move me", context=b"t2", aad=b"a")
    # derived -> itself keeps the context.
    same = ok(one(manager, "rewrap", "d-aes", operations.RewrapItem(token, b"a", context=b"t1")))
    opened = one(
        manager, "decrypt", "d-aes", operations.DecryptItem(same["ciphertext"], b"a", context=b"t1")
    )
    assert base64.b64decode(ok(opened)["plaintext"]) == b"move me"
    error(
        one(
            manager,
            "rewrap",
            "plain-aes",
            operations.RewrapItem(moved["ciphertext"], b"a", context=b"t"),
        ),
        InvalidRequest,
        "neither key is derived",
    )
    error(
        one(manager, "rewrap", "d-aes", operations.RewrapItem(token, b"a")),
        InvalidRequest,
        "'context'",
    )
    wrapped = ok(
        one(manager, "datakey", "d-aes", operations.DatakeyItem(plaintext=False, context=b"t"))
    )
    assert set(wrapped) == {"ciphertext", "key_version"}
    full = ok(one(manager, "datakey", "d-aes", operations.DatakeyItem(bits=128, context=b"t")))
    opened = one(
        manager, "decrypt", "d-aes", operations.DecryptItem(full["ciphertext"], context=b"t")
    )
    assert ok(opened)["plaintext"] == full["plaintext"]
    assert len(base64.b64decode(full["plaintext"])) == 16


def test_datakey_without_plaintext_on_plain_keys(manager: KeyManager) -> None:
    outcomes = operations.run_batch(
        manager.keyring,
        "datakey",
        "plain-aes",
        [
            operations.DatakeyItem(plaintext=False),
            operations.DatakeyItem(bits=128),
            operations.DatakeyItem(bits=7),
        ],
    )
    assert set(ok(outcomes[0])) == {"ciphertext", "key_version"}
    assert set(ok(outcomes[1])) == {"plaintext", "ciphertext", "key_version"}
    error(outcomes[2], InvalidRequest, "bits must be 128 or 256")
    dek = ok(
        one(manager, "decrypt", "plain-aes", operations.DecryptItem(ok(outcomes[0])["ciphertext"]))
    )
    assert len(base64.b64decode(dek["plaintext"])) == 32


# Creation and the keyring file -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("type_name", "derived", "convergent", "message"),
    [
        ("rsa-2048", True, False, "cannot be derived"),
        ("ecdsa-p256", True, False, "cannot be derived"),
        ("sm2", True, False, "cannot be derived"),
        ("aes256-gcm", False, True, "needs 'derived'"),
        ("hmac-sha256", True, True, "cannot be convergent"),
    ],
)
def test_flags_the_type_cannot_have_are_refused(
    tmp_path: Path, type_name: str, derived: bool, convergent: bool, message: str
) -> None:
    manager = new_manager(tmp_path)
    before = keyring_file(manager).read_bytes()
    with pytest.raises(InvalidRequest, match=message):
        manager.create("k", type_name, derived=derived, convergent=convergent)
    assert keyring_file(manager).read_bytes() == before  # nothing stored


def test_flags_persist_are_shown_and_are_covered_by_the_mac(tmp_path: Path) -> None:
    manager = new_manager(tmp_path)
    manager.create("c", "sm4-gcm", derived=True, convergent=True)
    manager.create("p", "aes256-gcm")
    token = encrypt(manager, "c", b"x", context=b"t")
    master = manager._master
    reloaded = KeyManager(FileKeyStore(keyring_file(manager)), master)
    reloaded.load()
    meta = reloaded.keyring.key("c").metadata()
    assert (meta["derived"], meta["convergent"]) == (True, True)
    assert (reloaded.keyring.key("p").metadata()["derived"]) is False
    assert ok(one(reloaded, "decrypt", "c", operations.DecryptItem(token, context=b"t")))
    raw = json.loads(keyring_file(manager).read_text())
    assert raw["keys"]["c"]["derived"] is True
    assert raw["keys"]["c"]["convergent"] is True
    assert "derived" not in raw["keys"]["p"]  # written only when true
    # Clearing the flag (or setting one) without the master key breaks the MAC: refused.
    edits: tuple[Callable[[dict[str, Any]], object], ...] = (
        lambda keys: keys["c"].pop("convergent"),
        lambda keys: keys["c"].update(derived=False),
        lambda keys: keys["p"].update(derived=True),
    )
    for edit in edits:
        changed = json.loads(keyring_file(manager).read_text())
        edit(changed["keys"])
        keyring_file(manager).write_text(json.dumps(changed))
        with pytest.raises(KeystoreError, match="integrity"):
            KeyManager(FileKeyStore(keyring_file(manager)), master).load()
        keyring_file(manager).write_text(json.dumps(raw))
    for bad in ("yes", 1, None):
        changed = json.loads(keyring_file(manager).read_text())
        changed["keys"]["c"]["derived"] = bad
        keyring_file(manager).write_text(json.dumps(changed))
        with pytest.raises(KeystoreError):
            KeyManager(FileKeyStore(keyring_file(manager)), master).load()
    keyring_file(manager).write_text(json.dumps(raw))


def test_batch_of_contexts_one_bad_item(manager: KeyManager) -> None:
    items: list[operations.Item] = [
        operations.EncryptItem(b"a", context=b"t1"),
        operations.EncryptItem(b"b"),
        operations.EncryptItem(b"c", context=b"t2"),
    ]
    outcomes = operations.run_batch(manager.keyring, "encrypt", "c-aes", items)
    assert isinstance(outcomes[1], InvalidRequest)
    assert ok(outcomes[0])["ciphertext"] == encrypt(manager, "c-aes", b"a", context=b"t1")
    assert ok(outcomes[2])
