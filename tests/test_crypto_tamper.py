"""Tamper tests through the engine over a real keyring (temp file, random master key).

Every damaged token must fail as ``decryption_failed`` with one fixed message, whatever was
damaged (no oracle). Version checks are the documented exceptions: a version below
``min_decryption_version`` is 400 ``invalid_request`` and a version above the latest is 404
``key_not_found`` - both concern the public ``v<N>`` prefix, not the binary body.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from service import operations
from service.crypto.registry import KEY_TYPES, KEY_TYPES_BY_ID
from service.errors import CryptdError, DecryptionFailed, InvalidRequest, KeyNotFound
from service.keys.admin import create_keyring_file
from service.keys.document import KeyringDocument, canonical
from service.keys.filestore import FileKeyStore
from service.keys.keyring import MAX_KEY_VERSION, Keyring
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeystoreError

AEAD_TYPES = ("aes256-gcm", "sm4-gcm")
HYBRID_TYPES = ("rsa-2048", "rsa-3072")
# HPKE (RFC 9180) bodies: enc || AEAD ciphertext || tag, no nonce (derived from the KEM secret).
HPKE_ENC = {"ml-kem-768": 1088, "ml-kem-1024": 1568, "x25519-ml-kem-768": 1120}
HPKE_TYPES = tuple(HPKE_ENC)
TYPES = AEAD_TYPES + HYBRID_TYPES + HPKE_TYPES
PLAINTEXT = b"twenty bytes of text"
AAD = b"context:tamper"
FAILED = DecryptionFailed()
NONCE, TAG = 12, 16
Json = dict[str, Any]


@dataclass
class Ring:
    manager: KeyManager
    master: MasterKey
    path: Path

    @property
    def keyring(self) -> Keyring:
        return self.manager.keyring


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Ring:
    """Keys ``a-<type>`` and ``b-<type>`` for every type under test, plus a signing key."""
    path = tmp_path_factory.mktemp("tamper") / "keyring.json"
    master = MasterKey(secrets.token_bytes(32))
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master)
    manager.load()
    for type_name in TYPES:
        manager.create(f"a-{type_name}", type_name)
        manager.create(f"b-{type_name}", type_name)
    manager.create("sig-ecdsa", "ecdsa-p256")
    return Ring(manager, master, path)


# Helpers --------------------------------------------------------------------------------------


def load_file(path: Path, master: MasterKey) -> Keyring:
    return KeyManager(FileKeyStore(path), master).load()


def run(
    ring: Ring, op: operations.OpName, name: str, *items: operations.Item
) -> list[operations.Outcome]:
    return operations.run_batch(ring.keyring, op, name, items)


def ok(outcome: operations.Outcome) -> operations.Result:
    assert isinstance(outcome, dict), f"expected a result, got {outcome!r}"
    return outcome


def encrypt(
    ring: Ring,
    name: str,
    plaintext: bytes = PLAINTEXT,
    aad: bytes = AAD,
    version: int | None = None,
) -> str:
    (outcome,) = run(ring, "encrypt", name, operations.EncryptItem(plaintext, aad, version))
    ciphertext = ok(outcome)["ciphertext"]
    assert isinstance(ciphertext, str)
    return ciphertext


def decrypt(ring: Ring, name: str, ciphertext: str, aad: bytes = AAD) -> operations.Outcome:
    (outcome,) = run(ring, "decrypt", name, operations.DecryptItem(ciphertext, aad))
    return outcome


def plaintext_of(outcome: operations.Outcome) -> bytes:
    return base64.b64decode(ok(outcome)["plaintext"])


def split(ciphertext: str) -> tuple[int, bytes]:
    """(version, binary data) of a token, decoded independently of service.keys.token."""
    prefix, version, text = ciphertext.split(":")
    assert prefix == "cryptd"
    assert version.startswith("v")
    return int(version[1:]), base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def join(version: int, data: bytes) -> str:
    return f"cryptd:v{version}:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def assert_all_failed(outcomes: Iterable[operations.Outcome]) -> None:
    """Each outcome is decryption_failed, with the one fixed message."""
    outcomes = list(outcomes)
    assert outcomes
    for outcome in outcomes:
        assert isinstance(outcome, DecryptionFailed), f"expected decryption_failed: {outcome!r}"
        assert outcome.code == "decryption_failed"
        assert outcome.message == FAILED.message == str(outcome)
    entries = {
        json.dumps(operations.error_entry(o)) for o in outcomes if isinstance(o, CryptdError)
    }
    assert entries == {
        json.dumps({"error": {"code": "decryption_failed", "message": FAILED.message}})
    }


def layout(type_name: str, data: bytes) -> dict[str, range]:
    found = {"format": range(0, 1), "type_id": range(1, 2)}
    start = 2
    if type_name in HYBRID_TYPES:
        wrapped = int.from_bytes(data[2:4], "big")
        assert wrapped == int(type_name.split("-")[1]) // 8  # one RSA block
        found["wrapped_key_length"] = range(2, 4)
        found["wrapped_key"] = range(4, 4 + wrapped)
        start = 4 + wrapped
    if type_name in HPKE_TYPES:
        found["enc"] = range(start, start + HPKE_ENC[type_name])
        start += HPKE_ENC[type_name]
    else:
        found["nonce"] = range(start, start + NONCE)
        start += NONCE
    found["ciphertext"] = range(start, len(data) - TAG)
    found["tag"] = range(len(data) - TAG, len(data))
    assert len(found["ciphertext"]) == len(PLAINTEXT)
    return found


def sample(positions: range, limit: int = 24) -> list[int]:
    """Every position of a short range; first, last and a spread of a long one."""
    if len(positions) <= limit:
        return list(positions)
    step = max(1, len(positions) // limit)
    return sorted({positions[0], positions[1], positions[-2], positions[-1], *positions[::step]})


def with_byte(data: bytes, index: int, value: int) -> bytes:
    changed = bytearray(data)
    changed[index] = value
    return bytes(changed)


def flipped(data: bytes, index: int, mask: int) -> bytes:
    return with_byte(data, index, data[index] ^ mask)


def tampered_bodies(type_name: str, data: bytes) -> dict[str, bytes]:
    """Named damaged copies of ``data``: every region, value swaps, truncations, extensions."""
    out: dict[str, bytes] = {}
    for name, positions in layout(type_name, data).items():
        for index in sample(positions):
            out[f"{name}[{index}]^01"] = flipped(data, index, 0x01)
        out[f"{name}[{positions[0]}]^80"] = flipped(data, positions[0], 0x80)
    for bit in range(8):
        out[f"format^{1 << bit:02x}"] = flipped(data, 0, 1 << bit)
        out[f"type_id^{1 << bit:02x}"] = flipped(data, 1, 1 << bit)
    for value in (0, 2, 0xFF):
        out[f"format={value}"] = with_byte(data, 0, value)
    for value in {0, 0xFF, *KEY_TYPES_BY_ID} - {data[1]}:
        out[f"type_id={value}"] = with_byte(data, 1, value)
    if type_name in HYBRID_TYPES:
        wrapped = int.from_bytes(data[2:4], "big")
        for value in (0, 1, wrapped - 1, wrapped + 1, len(data), 0xFFFF):
            out[f"wrapped_key_length={value}"] = data[:2] + value.to_bytes(2, "big") + data[4:]
    for length in sample(range(1, len(data)), limit=60):
        out[f"truncated to {length}"] = data[:length]
    for name, positions in layout(type_name, data).items():
        if positions[0] > 0:  # an empty text is not a token at all: see the bad-request test
            out[f"cut before {name}"] = data[: positions[0]]
        out[f"without {name}"] = data[: positions[0]] + data[positions[-1] + 1 :]
    out["extended by 00"] = data + b"\x00"
    out["extended by 16 bytes"] = data + os.urandom(16)
    out["header only"] = data[:2]
    out["tag duplicated"] = data + data[-TAG:]
    for name, changed in out.items():
        assert changed != data, name
    return out


# Damaged tokens -------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_every_region_of_the_token_is_authenticated(ring: Ring, type_name: str) -> None:
    name = f"a-{type_name}"
    ciphertext = encrypt(ring, name)
    version, data = split(ciphertext)
    assert (version, data[0], data[1]) == (1, 1, KEY_TYPES[type_name].type_id)
    damaged = tampered_bodies(type_name, data)
    items = [operations.DecryptItem(join(version, body), AAD) for body in damaged.values()]
    # The intact token rides in the same batch: one bad item never fails the others.
    outcomes = run(ring, "decrypt", name, *items, operations.DecryptItem(ciphertext, AAD))
    assert plaintext_of(outcomes[-1]) == PLAINTEXT
    for label, outcome in zip(damaged, outcomes[:-1], strict=True):
        assert isinstance(outcome, DecryptionFailed), f"{type_name} {label}: {outcome!r}"
    assert_all_failed(outcomes[:-1])


@pytest.mark.parametrize("type_name", TYPES)
def test_damaged_token_text_fails(ring: Ring, type_name: str) -> None:
    name = f"a-{type_name}"
    ciphertext = encrypt(ring, name)
    head, text = ciphertext.rsplit(":", 1)
    variants = [f"{head}:{text[:-cut]}" for cut in (1, 2, 3)]
    variants += [f"{head}:{text}A", f"{head}:{text}AA", f"{head}:A", f"{head}:AAAA"]
    # Change one character somewhere in the middle to another base64url character.
    middle = len(text) // 2
    other = "B" if text[middle] != "B" else "C"
    variants.append(f"{head}:{text[:middle]}{other}{text[middle + 1 :]}")
    assert_all_failed(decrypt(ring, name, variant) for variant in variants)


def test_token_text_is_canonical(ring: Ring) -> None:
    ciphertext = encrypt(ring, "a-aes256-gcm")
    _, data = split(ciphertext)
    assert len(data) % 3 != 0  # the last character carries unused bits
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(ciphertext[-1])
    variant = ciphertext[:-1] + alphabet[last ^ 0x01]
    assert variant != ciphertext
    assert split(variant)[1] == data  # same bytes, another string
    assert not isinstance(decrypt(ring, "a-aes256-gcm", variant), dict)


def test_strings_that_are_not_tokens_are_bad_requests(ring: Ring) -> None:
    for text in (
        "",
        "cryptd:v1:",
        "vault:v1:AAAA",
        "cryptd:v0:AAAA",
        "cryptd:v01:AAAA",
        "cryptd:v1:AA==",
        "cryptd:v1:AA+/",
        "cryptd:1:AAAA",
        "cryptd:v1:AAAA\n",
    ):
        outcome = decrypt(ring, "a-aes256-gcm", text)
        assert isinstance(outcome, InvalidRequest), text
        assert outcome.code == "invalid_request"


@pytest.mark.parametrize("type_name", TYPES)
def test_wrong_aad_fails(ring: Ring, type_name: str) -> None:
    name = f"a-{type_name}"
    ciphertext = encrypt(ring, name, aad=b"tenant=1")
    assert plaintext_of(decrypt(ring, name, ciphertext, aad=b"tenant=1")) == PLAINTEXT
    wrong = [b"", b"tenant=2", b"tenant=1\x00", b"tenant=", b"TENANT=1", b"tenant=1tenant=1"]
    assert_all_failed(decrypt(ring, name, ciphertext, aad=aad) for aad in wrong)
    unbound = encrypt(ring, name, aad=b"")
    assert plaintext_of(decrypt(ring, name, unbound, aad=b"")) == PLAINTEXT
    assert_all_failed([decrypt(ring, name, unbound, aad=b"x")])


@pytest.mark.parametrize("type_name", TYPES)
def test_token_of_one_key_is_refused_by_every_other_key(ring: Ring, type_name: str) -> None:
    ciphertext = encrypt(ring, f"a-{type_name}")
    version, data = split(ciphertext)
    outcomes = []
    for target_type in TYPES:
        for target in (f"a-{target_type}", f"b-{target_type}"):
            if target == f"a-{type_name}":
                continue
            outcomes.append(decrypt(ring, target, ciphertext))
            # The same body relabelled with the target's type id still fails (the key and the
            # associated data differ).
            relabelled = with_byte(data, 1, KEY_TYPES[target_type].type_id)
            outcomes.append(decrypt(ring, target, join(version, relabelled)))
    assert len(outcomes) == 2 * (2 * len(TYPES) - 1)
    assert_all_failed(outcomes)


# Versions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_rotation_and_version_prefix(ring: Ring, type_name: str) -> None:
    name = f"rot-{type_name}"
    ring.manager.create(name, type_name)
    old = encrypt(ring, name)
    assert old.startswith("cryptd:v1:")
    key = ring.manager.rotate(name)
    assert key.latest_version == 2
    (outcome,) = run(ring, "encrypt", name, operations.EncryptItem(PLAINTEXT, AAD))
    assert ok(outcome)["key_version"] == 2
    new = ok(outcome)["ciphertext"]
    assert new.startswith("cryptd:v2:")
    # Old tokens still decrypt, and say which version they used.
    assert ok(decrypt(ring, name, old)) == {
        "plaintext": operations.b64(PLAINTEXT),
        "key_version": 1,
    }
    assert ok(decrypt(ring, name, new)) == {
        "plaintext": operations.b64(PLAINTEXT),
        "key_version": 2,
    }
    # Relabelling a body with the other version's prefix fails: the version is bound.
    (_, old_data), (_, new_data) = split(old), split(new)
    assert_all_failed(
        [decrypt(ring, name, join(2, old_data)), decrypt(ring, name, join(1, new_data))]
    )
    # Encrypting under an explicit older version still works while it is allowed.
    older = encrypt(ring, name, version=1)
    assert older.startswith("cryptd:v1:")
    assert plaintext_of(decrypt(ring, name, older)) == PLAINTEXT


@pytest.mark.parametrize("type_name", TYPES)
def test_min_decryption_version_and_missing_versions(ring: Ring, type_name: str) -> None:
    name = f"min-{type_name}"
    ring.manager.create(name, type_name)
    old = encrypt(ring, name)
    ring.manager.rotate(name)
    new = encrypt(ring, name)
    ring.manager.update(name, min_decryption_version=2)
    refused = [
        decrypt(ring, name, old),
        *run(ring, "rewrap", name, operations.RewrapItem(old, AAD)),
        *run(ring, "encrypt", name, operations.EncryptItem(PLAINTEXT, AAD, key_version=1)),
        *run(ring, "decrypt", name, operations.DecryptItem(new, AAD, key_version=1)),
    ]
    for outcome in refused:
        assert isinstance(outcome, InvalidRequest), outcome
        assert outcome.code == "invalid_request"
    assert plaintext_of(decrypt(ring, name, new)) == PLAINTEXT
    # A version above the latest is 404, in the token or in the request; above the bound
    # (the token's u32 field) it is malformed: 400.
    _, data = split(new)
    missing = [
        decrypt(ring, name, join(3, data)),
        decrypt(ring, name, join(MAX_KEY_VERSION, data)),
        *run(ring, "encrypt", name, operations.EncryptItem(PLAINTEXT, AAD, key_version=7)),
    ]
    for outcome in missing:
        assert isinstance(outcome, KeyNotFound), outcome
        assert outcome.code == "key_not_found"
    beyond = [
        decrypt(ring, name, join(MAX_KEY_VERSION + 1, data)),
        decrypt(ring, name, join(9_999_999_999, data)),
        *run(ring, "encrypt", name, operations.EncryptItem(PLAINTEXT, AAD, key_version=2**63)),
    ]
    for outcome in beyond:
        assert isinstance(outcome, InvalidRequest), outcome
    with pytest.raises(InvalidRequest):
        ring.manager.update(name, min_decryption_version=3)


def test_key_version_that_contradicts_the_token_is_refused(ring: Ring) -> None:
    ciphertext = encrypt(ring, "a-aes256-gcm")
    (outcome,) = run(
        ring, "decrypt", "a-aes256-gcm", operations.DecryptItem(ciphertext, AAD, None, 2)
    )
    assert isinstance(outcome, InvalidRequest)
    (outcome,) = run(
        ring, "decrypt", "a-aes256-gcm", operations.DecryptItem(ciphertext, AAD, None, 1)
    )
    assert plaintext_of(outcome) == PLAINTEXT


# Rewrap and data keys -------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_rewrap_to_latest_version(ring: Ring, type_name: str) -> None:
    name = f"rw-{type_name}"
    ring.manager.create(name, type_name)
    old = encrypt(ring, name)
    ring.manager.rotate(name)
    (outcome,) = run(ring, "rewrap", name, operations.RewrapItem(old, AAD))
    result = ok(outcome)
    assert result["key_version"] == 2
    assert result["ciphertext"].startswith("cryptd:v2:")
    assert set(result) == {"ciphertext", "key_version"}  # the plaintext never leaves
    assert plaintext_of(decrypt(ring, name, result["ciphertext"])) == PLAINTEXT
    assert_all_failed(run(ring, "rewrap", name, operations.RewrapItem(old, b"other aad")))


@pytest.mark.parametrize("source", TYPES)
def test_rewrap_to_another_key(ring: Ring, source: str) -> None:
    ciphertext = encrypt(ring, f"a-{source}")
    for target_type in TYPES:
        target = f"b-{target_type}"
        (outcome,) = run(
            ring, "rewrap", f"a-{source}", operations.RewrapItem(ciphertext, AAD, target)
        )
        moved = ok(outcome)["ciphertext"]
        assert split(moved)[1][1] == KEY_TYPES[target_type].type_id
        assert plaintext_of(decrypt(ring, target, moved)) == PLAINTEXT
        assert_all_failed([decrypt(ring, f"a-{source}", moved), decrypt(ring, target, ciphertext)])
    (unknown,) = run(ring, "rewrap", f"a-{source}", operations.RewrapItem(ciphertext, AAD, "nope"))
    assert isinstance(unknown, KeyNotFound)
    (signing,) = run(
        ring, "rewrap", f"a-{source}", operations.RewrapItem(ciphertext, AAD, "sig-ecdsa")
    )
    assert isinstance(signing, InvalidRequest)


@pytest.mark.parametrize("type_name", TYPES)
def test_datakey_decrypts_back(ring: Ring, type_name: str) -> None:
    name = f"a-{type_name}"
    items = [
        operations.DatakeyItem(128, AAD),
        operations.DatakeyItem(256, AAD),
        operations.DatakeyItem(),
    ]
    results = [ok(o) for o in run(ring, "datakey", name, *items)]
    for item, result, size in zip(items, results, (16, 32, 32), strict=True):
        data_key = base64.b64decode(result["plaintext"])
        assert len(data_key) == size
        assert result["key_version"] == 1
        assert plaintext_of(decrypt(ring, name, result["ciphertext"], aad=item.aad)) == data_key
    assert len({r["plaintext"] for r in results}) == 3  # fresh keys
    assert_all_failed([decrypt(ring, name, results[0]["ciphertext"], aad=b"")])
    (bad,) = run(ring, "datakey", name, operations.DatakeyItem(192))
    assert isinstance(bad, InvalidRequest)


# The keyring file -----------------------------------------------------------------------------


def encodings(secret: bytes) -> list[bytes]:
    """Ways plaintext material could appear in a JSON file."""
    found = [secret, secret.hex().encode(), secret.hex().upper().encode()]
    for offset in range(3):  # base64 at any alignment inside a longer value
        chunk = secret[offset : offset + 24]
        found.append(base64.b64encode(chunk)[:-4] if offset else base64.b64encode(chunk))
        found.append(base64.urlsafe_b64encode(chunk).rstrip(b"=")[:-4])
    return found


def unwrapped(ring: Ring, document: KeyringDocument) -> Iterable[tuple[str, int, bytes]]:
    for name, record in document.keys.items():
        for version in record.versions:
            material = ring.master.unwrap(
                version.material, name=name, version=version.version, type_name=record.type
            )
            yield name, version.version, material


@pytest.mark.slow
def test_keyring_file_holds_no_plaintext_material(ring: Ring) -> None:
    raw = ring.path.read_bytes()
    assert stat.S_IMODE(ring.path.stat().st_mode) == 0o600
    document = KeyringDocument.parse(json.loads(raw))
    checked = 0
    for name, version, material in unwrapped(ring, document):
        assert KEY_TYPES[document.keys[name].type].load(material) is not None
        needles = encodings(material)
        if document.keys[name].type in HYBRID_TYPES:
            private = serialization.load_der_private_key(material, password=None)
            assert isinstance(private, rsa.RSAPrivateKey)
            numbers = private.private_numbers()
            for secret in (numbers.d, numbers.p, numbers.q):
                needles += encodings(secret.to_bytes((secret.bit_length() + 7) // 8, "big"))
        for needle in needles:
            assert needle not in raw, f"{name} v{version}: material found in the file"
        checked += 1
    assert checked >= 2 * len(TYPES)
    blobs = [v.material for r in document.keys.values() for v in r.versions]
    assert len(set(blobs)) == len(blobs)


def test_keyring_refuses_a_wrong_master_key(ring: Ring, tmp_path: Path) -> None:
    other = MasterKey(secrets.token_bytes(32))
    assert other.key_id != ring.master.key_id
    with pytest.raises(KeystoreError):
        load_file(ring.path, other)
    # Same claimed key id, wrong key: the first blob does not unwrap.
    data = json.loads(ring.path.read_bytes())
    data["master_key_id"] = other.key_id
    forged = tmp_path / "forged.json"
    forged.write_bytes(json.dumps(data).encode())
    with pytest.raises(KeystoreError):
        load_file(forged, other)


def edited_copy(
    ring: Ring, tmp_path: Path, label: str, edit: Callable[[Json], None], *, remac: bool = False
) -> Path:
    """A copy of the keyring file with ``edit(data)`` applied to its JSON. With ``remac`` the
    document MAC is recomputed, so the wrapping's own binding is what gets tested."""
    data: Json = json.loads(ring.path.read_bytes())
    edit(data)
    if remac:
        data["mac"] = base64.b64encode(ring.master.mac(canonical(data))).decode()
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps(data))
    return path


def test_material_is_bound_to_its_key_version_and_type(ring: Ring, tmp_path: Path) -> None:
    ring.manager.create("bind-aes", "aes256-gcm")
    ring.manager.rotate("bind-aes")
    pristine = tmp_path / "pristine.json"
    shutil.copy(ring.path, pristine)
    assert "bind-aes" in load_file(pristine, ring.master)

    def blob(data: Json, key: str, index: int) -> str:
        value: str = data["keys"][key]["versions"][index]["material"]
        return value

    def set_blob(data: Json, key: str, index: int, value: str) -> None:
        data["keys"][key]["versions"][index]["material"] = value

    def move_between_keys(data: Json) -> None:  # key A v1 into key B v1 (same type)
        set_blob(data, "b-aes256-gcm", 0, blob(data, "a-aes256-gcm", 0))

    def swap_versions(data: Json) -> None:  # v1 and v2 of one key
        first, second = blob(data, "bind-aes", 0), blob(data, "bind-aes", 1)
        set_blob(data, "bind-aes", 0, second)
        set_blob(data, "bind-aes", 1, first)

    def relabel_type(data: Json) -> None:  # rsa-2048 material declared rsa-3072
        data["keys"]["a-rsa-2048"]["type"] = "rsa-3072"

    def rename_key(data: Json) -> None:  # the whole record under another name
        data["keys"]["renamed"] = data["keys"].pop("a-sm4-gcm")

    def flip_blob(data: Json) -> None:
        damaged = bytearray(base64.b64decode(blob(data, "a-aes256-gcm", 0)))
        damaged[-1] ^= 1
        set_blob(data, "a-aes256-gcm", 0, base64.b64encode(bytes(damaged)).decode())

    for edit in (move_between_keys, swap_versions, relabel_type, rename_key, flip_blob):
        for remac in (False, True):  # refused by the document MAC, and by the wrapping alone
            path = edited_copy(ring, tmp_path, edit.__name__, edit, remac=remac)
            with pytest.raises(KeystoreError):
                load_file(path, ring.master)


def test_metadata_is_authenticated(ring: Ring, tmp_path: Path) -> None:
    ring.manager.create("meta-aes", "aes256-gcm")
    ring.manager.rotate("meta-aes")
    ring.manager.update("meta-aes", min_decryption_version=2)

    def lower_min_version(data: Json) -> None:
        data["keys"]["meta-aes"]["min_decryption_version"] = 1

    def undo_rotation(data: Json) -> None:
        data["keys"]["meta-aes"]["versions"].pop()
        data["keys"]["meta-aes"]["min_decryption_version"] = 1

    def allow_deletion(data: Json) -> None:
        data["keys"]["meta-aes"]["deletion_allowed"] = True

    def drop_mac(data: Json) -> None:
        del data["mac"]

    for edit in (lower_min_version, undo_rotation, allow_deletion, drop_mac):
        path = edited_copy(ring, tmp_path, edit.__name__, edit)
        with pytest.raises(KeystoreError):
            load_file(path, ring.master)
    # the same edits with a MAC recomputed under the master key load: the MAC is what refused
    path = edited_copy(ring, tmp_path, "remac", lower_min_version, remac=True)
    assert load_file(path, ring.master)["meta-aes"].min_decryption_version == 1


def test_failed_reload_keeps_the_previous_keyring(ring: Ring, tmp_path: Path) -> None:
    path = tmp_path / "reload.json"
    shutil.copy(ring.path, path)
    manager = KeyManager(FileKeyStore(path), ring.master)
    before = manager.load()
    data = json.loads(path.read_bytes())
    data["keys"]["b-sm4-gcm"]["versions"][0]["material"] = data["keys"]["a-sm4-gcm"]["versions"][0][
        "material"
    ]
    path.write_text(json.dumps(data))
    assert manager.reload() is False
    assert manager.keyring is before
    assert manager.last_reload_error is not None


def test_decryption_errors_carry_no_detail(ring: Ring) -> None:
    """Every failure path yields the same error object shape: nothing to tell them apart."""
    ciphertext = encrypt(ring, "a-rsa-2048")
    version, data = split(ciphertext)
    samples: Sequence[operations.Outcome] = [
        decrypt(ring, "a-rsa-2048", join(version, flipped(data, 0, 1))),  # format byte
        decrypt(ring, "a-rsa-2048", join(version, flipped(data, 10, 1))),  # OAEP
        decrypt(ring, "a-rsa-2048", join(version, flipped(data, len(data) - 1, 1))),  # GCM tag
        decrypt(ring, "a-rsa-2048", ciphertext, aad=b"wrong"),
        decrypt(ring, "b-rsa-2048", ciphertext),
        decrypt(ring, "a-aes256-gcm", ciphertext),
    ]
    assert_all_failed(samples)
    entries = {json.dumps(operations.error_entry(o)) for o in samples if isinstance(o, CryptdError)}
    assert entries == {
        json.dumps({"error": {"code": "decryption_failed", "message": FAILED.message}})
    }
