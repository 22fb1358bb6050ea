"""The token and keyring formats of docs/FORMAT.md, checked in both directions.

Each documented vector is (1) rebuilt here from the description alone with pyca/cryptography and
compared with the documented string, and (2) decrypted by cryptd's engine from a keyring holding
the documented key material. The vectors live in tests/vectors/token_vectors.json; the tests
also require the document to show exactly those values, so the two cannot drift apart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import random
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service import operations
from service.config import decode_master_key
from service.crypto.registry import KEY_TYPES
from service.errors import DecryptionFailed, InvalidRequest
from service.keys import token
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "FORMAT.md").read_text()
VECTORS: dict[str, Any] = json.loads(
    (ROOT / "tests" / "vectors" / "token_vectors.json").read_text()
)
RSA_PEM = (ROOT / "tests" / "vectors" / "rsa2048_test_key.pem").read_bytes()
OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


def h(text: str) -> bytes:
    return bytes.fromhex(text)


# The format, implemented here from docs/FORMAT.md only ----------------------------------------


def doc_associated_data(name: str, version: int, type_id: int, aad: bytes) -> bytes:
    encoded = name.encode("ascii")
    return b"cryptd/1" + bytes([type_id, len(encoded)]) + version.to_bytes(4, "big") + encoded + aad


def doc_token(version: int, type_id: int, body: bytes) -> str:
    data = bytes([1, type_id]) + body
    return f"cryptd:v{version}:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def doc_parse(text: str) -> tuple[int, int, bytes]:
    match = re.fullmatch(r"cryptd:v([1-9][0-9]{0,9}):([A-Za-z0-9_-]+)", text)
    assert match is not None
    data = base64.urlsafe_b64decode(match.group(2) + "=" * (-len(match.group(2)) % 4))
    assert data[0] == 1
    return int(match.group(1)), data[1], data[2:]


def sm4_gcm_seal(key: bytes, nonce: bytes, plaintext: bytes, ad: bytes) -> bytes:
    encryptor = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(ad)
    ciphertext = encryptor.update(plaintext) + encryptor.finalize()
    return ciphertext + encryptor.tag


def sm4_gcm_open(key: bytes, nonce: bytes, sealed: bytes, ad: bytes) -> bytes:
    decryptor = Cipher(algorithms.SM4(key), modes.GCM(nonce, sealed[-16:])).decryptor()
    decryptor.authenticate_additional_data(ad)
    return decryptor.update(sealed[:-16]) + decryptor.finalize()


def doc_aead_body(type_name: str, key: bytes, nonce: bytes, plaintext: bytes, ad: bytes) -> bytes:
    if type_name == "aes256-gcm":
        return nonce + AESGCM(key).encrypt(nonce, plaintext, ad)
    return nonce + sm4_gcm_seal(key, nonce, plaintext, ad)


def doc_aead_open(type_name: str, key: bytes, body: bytes, ad: bytes) -> bytes:
    nonce, sealed = body[:12], body[12:]
    if type_name == "aes256-gcm":
        return AESGCM(key).decrypt(nonce, sealed, ad)
    return sm4_gcm_open(key, nonce, sealed, ad)


# A keyring holding documented material --------------------------------------------------------


def new_manager(directory: Path) -> KeyManager:
    master = MasterKey(os.urandom(32))
    path = directory / "keyring.json"
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master)
    manager.load()
    return manager


def imported(type_name: str, external: bytes) -> bytes:
    import_key = KEY_TYPES[type_name].import_key
    assert import_key is not None
    return import_key(external)


def engine_decrypt(manager: KeyManager, name: str, ciphertext: str, aad: bytes) -> bytes:
    (outcome,) = operations.run_batch(
        manager.keyring, "decrypt", name, [operations.DecryptItem(ciphertext, aad)]
    )
    assert isinstance(outcome, dict), outcome
    return base64.b64decode(outcome["plaintext"])


@pytest.fixture(scope="module")
def documented(tmp_path_factory: pytest.TempPathFactory) -> KeyManager:
    """The documented keys: doc-aes v1, doc-sm4 v2 (v1 random), doc-rsa v1 (the test key)."""
    manager = new_manager(tmp_path_factory.mktemp("documented"))
    aes, sm4 = VECTORS["aes256-gcm"], VECTORS["sm4-gcm"]
    manager.create(aes["name"], "aes256-gcm", material=imported("aes256-gcm", h(aes["key"])))
    manager.create(sm4["name"], "sm4-gcm")
    manager.rotate(sm4["name"], material=imported("sm4-gcm", h(sm4["key"])))
    manager.create("doc-rsa", "rsa-2048", material=imported("rsa-2048", RSA_PEM))
    return manager


# Token framing --------------------------------------------------------------------------------


def test_encode_follows_the_documented_layout() -> None:
    for version, type_id, body in [(1, 1, b""), (7, 2, b"\x00\xff body"), (4294967295, 8, b"x")]:
        text = token.encode(version, type_id, body)
        assert text == doc_token(version, type_id, body)
        assert "=" not in text
        assert token.decode(text) == (version, type_id, body)
        assert doc_parse(text) == (version, type_id, body)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "cryptd:v1:",
        "cryptd:v0:AQE",
        "cryptd:v007:AQE",
        "cryptd:v12345678901:AQE",
        "cryptd:v1:AQE=",
        "cryptd:v1:AQ+/",
        "Cryptd:v1:AQE",
        "cryptd:v1:AQE ",
        "cryptd:v1:AQE\n",
    ],
)
def test_decode_refuses_strings_that_are_not_tokens(text: str) -> None:
    with pytest.raises(InvalidRequest):
        token.decode(text)


@pytest.mark.parametrize("data", [b"\x01", b"\x00\x01body", b"\x02\x01body", b"\xff\x01"], ids=repr)
def test_decode_refuses_damaged_binary_as_decryption_failure(data: bytes) -> None:
    text = "cryptd:v1:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    with pytest.raises(DecryptionFailed):
        token.decode(text)


def test_decode_refuses_impossible_base64_length() -> None:
    with pytest.raises(DecryptionFailed):
        token.decode("cryptd:v1:AQEBA")  # 5 characters: no base64 has that length


def _reference_split(text: str) -> tuple[int, bytes | None] | None:
    """The token's text as the document describes it: the pattern, then base64url that must
    decode and encode back to itself."""
    match = re.fullmatch(r"cryptd:v([1-9][0-9]{0,9}):([A-Za-z0-9_-]+)", text)
    if match is None:
        return None
    encoded = match.group(2)
    try:
        data = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except binascii.Error:
        return int(match.group(1)), None
    if base64.urlsafe_b64encode(data).rstrip(b"=").decode() != encoded:
        return int(match.group(1)), None
    return int(match.group(1)), data


def _outcome(function: Any, text: str) -> object:
    try:
        return function(text)
    except (InvalidRequest, DecryptionFailed) as exc:
        return type(exc)


def test_decode_and_decode_mac_agree_with_the_documented_reading() -> None:
    rng = random.Random(20261201)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_+/=: \n.é"
    seen: set[object] = set()
    for size in [0, 1, 2, 3, 4, 30, 1054]:
        body = bytes([1, 1]) + rng.randbytes(size)
        good = token.encode(rng.choice([1, 7, 4294967295]), 1, body)
        for _ in range(300):
            position = rng.choice([len(good) - 1, rng.randrange(len(good) + 1)])
            text = rng.choice(
                [
                    good[:position] + rng.choice(alphabet) + good[position + 1 :],
                    good[:position] + rng.choice(alphabet) + good[position:],
                    good[:position] + good[position + 1 :],
                    good[:position],
                ]
            )
            split = _reference_split(text)
            if split is None:
                expected: object = InvalidRequest
            elif split[1] is None or len(split[1]) < 2 or split[1][0] != 1:
                expected = DecryptionFailed
            else:
                expected = (split[0], split[1][1], split[1][2:])
            assert _outcome(token.decode, text) == expected, repr(text)
            mac = InvalidRequest if split is None else split
            assert _outcome(token.decode_mac, text) == mac, repr(text)
            seen.add(expected if isinstance(expected, type) else tuple)
    assert seen == {InvalidRequest, DecryptionFailed, tuple}  # every outcome was exercised


def test_associated_data_construction() -> None:
    assert token.associated_data("k", 1, 1, b"") == b"cryptd/1\x01\x01\x00\x00\x00\x01k"
    for name, version, type_id, aad in [
        ("doc-aes", 1, 1, b"order-42"),
        ("a" * 128, 4294967295, 8, b"\x00" * 40),
        ("x.y_z-0", 3, 5, b""),
    ]:
        expected = doc_associated_data(name, version, type_id, aad)
        assert token.associated_data(name, version, type_id, aad) == expected
        assert expected == b"cryptd/1" + struct.pack(">BBI", type_id, len(name), version) + (
            name.encode() + aad
        )
    # Length-delimited: moving bytes between the name and the aad changes the result.
    assert token.associated_data("ab", 1, 1, b"c") != token.associated_data("a", 1, 1, b"bc")
    assert token.associated_data("a", 1, 1, b"") != token.associated_data("a", 2, 1, b"")
    assert token.associated_data("a", 1, 1, b"") != token.associated_data("a", 1, 2, b"")


def test_type_id_table_matches_the_registry() -> None:
    section = DOC.split("## 3. Key type ids", 1)[1].split("## 4.", 1)[0]
    table = {
        name: int(number)
        for number, name in re.findall(r"^\| (\d+) \| `([a-z0-9-]+)` \|", section, re.M)
    }
    assert table == {t.name: t.type_id for t in KEY_TYPES.values()}
    assert len(set(table.values())) == len(table)


# Documented vectors ---------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["aes256-gcm", "sm4-gcm"])
def test_aead_vector_is_rebuilt_from_the_document(type_name: str) -> None:
    vector = VECTORS[type_name]
    ad = doc_associated_data(vector["name"], vector["version"], vector["type_id"], h(vector["aad"]))
    assert ad.hex() == vector["associated_data"]
    assert ad == token.associated_data(
        vector["name"], vector["version"], KEY_TYPES[type_name].type_id, h(vector["aad"])
    )
    body = doc_aead_body(
        type_name, h(vector["key"]), h(vector["nonce"]), h(vector["plaintext"]), ad
    )
    assert doc_token(vector["version"], vector["type_id"], body) == vector["token"]
    ciphertext, tag = body[12:-16].hex(), body[-16:].hex()
    for value in (vector["token"], vector["key"], vector["nonce"], vector["associated_data"]):
        assert value in DOC
    assert f"| ciphertext | `{ciphertext}` |" in DOC
    assert f"| tag | `{tag}` |" in DOC


@pytest.mark.parametrize("type_name", ["aes256-gcm", "sm4-gcm"])
def test_engine_decrypts_the_documented_aead_token(documented: KeyManager, type_name: str) -> None:
    vector = VECTORS[type_name]
    plaintext = engine_decrypt(documented, vector["name"], vector["token"], h(vector["aad"]))
    assert plaintext == h(vector["plaintext"])


@pytest.mark.parametrize("type_name", ["aes256-gcm", "sm4-gcm"])
def test_engine_tokens_open_by_the_document(documented: KeyManager, type_name: str) -> None:
    """The other direction: what the engine writes, the description alone decrypts."""
    vector = VECTORS[type_name]
    item = operations.EncryptItem(b"written by the engine", b"aad")
    (outcome,) = operations.run_batch(documented.keyring, "encrypt", vector["name"], [item])
    assert isinstance(outcome, dict)
    version, type_id, body = doc_parse(outcome["ciphertext"])
    assert (version, type_id) == (vector["version"], vector["type_id"])
    ad = doc_associated_data(vector["name"], version, type_id, b"aad")
    assert doc_aead_open(type_name, h(vector["key"]), body, ad) == b"written by the engine"


def test_rsa_vector_layout_and_engine_decrypt(documented: KeyManager) -> None:
    vector = VECTORS["rsa-2048"]
    private = serialization.load_pem_private_key(RSA_PEM, password=None)
    assert isinstance(private, rsa.RSAPrivateKey)
    assert private.key_size == 2048
    assert RSA_PEM.decode().strip() in DOC
    assert vector["token"] in DOC
    version, type_id, body = doc_parse(vector["token"])
    assert (version, type_id) == (1, 3)
    wrapped_len = int.from_bytes(body[:2], "big")
    assert wrapped_len == 256
    wrapped, rest = body[2 : 2 + wrapped_len], body[2 + wrapped_len :]
    assert wrapped.hex() == vector["wrapped_key"]
    assert private.decrypt(wrapped, OAEP) == h(vector["data_key"])
    assert rest[:12] == h(vector["nonce"])
    ad = doc_associated_data(vector["name"], 1, 3, h(vector["aad"]))
    assert ad.hex() == vector["associated_data"]
    assert AESGCM(h(vector["data_key"])).decrypt(rest[:12], rest[12:], ad) == h(vector["plaintext"])
    for value in (vector["data_key"], vector["nonce"], vector["associated_data"]):
        assert value in DOC
    assert f"| ciphertext | `{rest[12:-16].hex()}` (AES-256-GCM under the DEK) |" in DOC
    assert f"| tag | `{rest[-16:].hex()}` |" in DOC
    assert engine_decrypt(documented, "doc-rsa", vector["token"], h(vector["aad"])) == h(
        vector["plaintext"]
    )


def test_rsa_token_built_from_the_document_decrypts(documented: KeyManager) -> None:
    """A fresh hybrid token made by another implementation (public key only) decrypts."""
    private = serialization.load_pem_private_key(RSA_PEM, password=None)
    assert isinstance(private, rsa.RSAPrivateKey)
    dek, nonce = os.urandom(32), os.urandom(12)
    ad = doc_associated_data("doc-rsa", 1, 3, b"built elsewhere")
    wrapped = private.public_key().encrypt(dek, OAEP)
    body = struct.pack(">H", len(wrapped)) + wrapped + nonce + AESGCM(dek).encrypt(nonce, b"hi", ad)
    text = doc_token(1, 3, body)
    assert engine_decrypt(documented, "doc-rsa", text, b"built elsewhere") == b"hi"


def test_documented_python_recipe_runs() -> None:
    recipe = DOC.split("```python", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(recipe, "FORMAT.md", "exec"), namespace)  # noqa: S102 - our own document
    assert namespace["token"] == VECTORS["aes256-gcm"]["token"]


# Keyring file and master-key wrapping ---------------------------------------------------------


def doc_context(name: str, version: int, type_name: str) -> bytes:
    return (
        b"cryptd-keyring/1\x00"
        + name.encode()
        + b"\x00"
        + str(version).encode()
        + (b"\x00" + type_name.encode())
    )


def test_master_key_wrapping_vector() -> None:
    vector = VECTORS["master_key"]
    key = h(vector["master_key"])
    assert decode_master_key(vector["master_key_base64"]) == key
    master = MasterKey(key)
    expected_id = hmac.new(key, b"cryptd master key id", hashlib.sha256).hexdigest()[:16]
    assert master.key_id == expected_id == vector["key_id"]
    context = doc_context(vector["name"], vector["version"], vector["type"])
    assert context.hex() == vector["context"]
    blob = h(vector["blob"])
    assert blob[:12] == h(vector["nonce"])
    assert AESGCM(key).encrypt(blob[:12], h(vector["material"]), context) == blob[12:]
    assert master.unwrap(blob, name=vector["name"], version=1, type_name=vector["type"]) == h(
        vector["material"]
    )
    for value in (vector["key_id"], vector["context"], vector["blob"], vector["master_key_base64"]):
        assert value in DOC


def test_documented_keyring_file_loads_and_decrypts(tmp_path: Path) -> None:
    vector = VECTORS["master_key"]
    shown = DOC.split("```json", 1)[1].split("```", 1)[0]
    assert json.loads(shown) == vector["keyring_file"]
    path = tmp_path / "keyring.json"
    path.write_text(shown)
    manager = KeyManager(FileKeyStore(path), MasterKey(h(vector["master_key"])))
    manager.load()
    aes = VECTORS["aes256-gcm"]
    assert engine_decrypt(manager, "doc-aes", aes["token"], h(aes["aad"])) == h(aes["plaintext"])


def test_keyring_written_by_the_service_follows_the_document(tmp_path: Path) -> None:
    key = os.urandom(32)
    master = MasterKey(key)
    path = tmp_path / "keyring.json"
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master)
    manager.load()
    manager.create("k.1", "sm4-gcm")
    manager.rotate("k.1")
    manager.create("e", "ed25519")
    data = json.loads(path.read_bytes())
    assert data["format"] == "cryptd-keyring/2"
    assert data["master_key_id"] == master.key_id
    assert re.fullmatch(r"[0-9a-f]{16}", data["deployment_id"])
    assert data["generation"] == 4  # created empty, then three changes
    assert set(data["keys"]) == {"k.1", "e"}
    # The document MAC, recomputed as docs/FORMAT.md says.
    mac_key = hmac.new(key, b"cryptd keyring mac", hashlib.sha256).digest()
    content = {k: v for k, v in data.items() if k != "mac"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    expected = hmac.new(mac_key, canonical, hashlib.sha256).digest()
    assert base64.b64decode(data["mac"]) == expected
    for name, record in data["keys"].items():
        assert set(record) == {
            "type",
            "created_at",
            "min_decryption_version",
            "deletion_allowed",
            "auto_rotate_period",
            "versions",
        }
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["created_at"])
        assert [v["version"] for v in record["versions"]] == list(
            range(1, len(record["versions"]) + 1)
        )
        for entry in record["versions"]:
            blob = base64.b64decode(entry["material"], validate=True)
            context = doc_context(name, entry["version"], record["type"])
            material = AESGCM(key).decrypt(blob[:12], blob[12:], context)
            assert len(material) == {"sm4-gcm": 16, "ed25519": 32}[record["type"]]
            assert KEY_TYPES[record["type"]].load(material) is not None
    assert KeyManager(FileKeyStore(path), master).load().key("k.1").latest_version == 2
