"""Ed25519 signs in libsodium (PyNaCl) up to SODIUM_MAX_MESSAGE bytes and in OpenSSL
(pyca/cryptography) above: both must give the bytes the other gives, and pyca must verify them.

The RFC 8032 known answers are in test_crypto_vectors.py; these tests compare the two libraries
on random seeds and messages on each side of the switch, and check the handle's contract.
"""

from __future__ import annotations

import os
import pickle

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from nacl.bindings import crypto_sign, crypto_sign_seed_keypair

from service.crypto.base import InvalidKeyMaterial, InvalidOptions, SignOptions
from service.crypto.ed25519 import SODIUM_MAX_MESSAGE, Ed25519Key
from service.crypto.registry import KEY_TYPES

NO_OPTIONS = SignOptions()
ED25519 = KEY_TYPES["ed25519"]
SIZES = [0, 1, 32, 1023, SODIUM_MAX_MESSAGE, SODIUM_MAX_MESSAGE + 1, 1024 * 1024]
SEEDS = 4


def _seeds() -> list[bytes]:
    return [os.urandom(32) for _ in range(SEEDS)]


@pytest.mark.parametrize("size", SIZES)
def test_signature_is_pycas_and_pyca_verifies_it(size: int) -> None:
    for seed in _seeds():
        message = os.urandom(size)
        handle = ED25519.load(seed)
        reference = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
        expected = reference.sign(message)
        # libsodium itself, whatever the handle picks for this size, gives pyca's bytes.
        assert crypto_sign(message, crypto_sign_seed_keypair(seed)[1])[:64] == expected
        signature = handle.sign(message, prehashed=False, options=NO_OPTIONS)
        assert signature == expected
        reference.public_key().verify(signature, message)  # raises if it does not verify
        assert handle.verify(signature, message, prehashed=False, options=NO_OPTIONS) is True
        assert (
            handle.verify(signature, message + b"\x00", prehashed=False, options=NO_OPTIONS)
            is False
        )
        if message:
            changed = bytes([message[0] ^ 0x01]) + message[1:]
            assert handle.verify(signature, changed, prehashed=False, options=NO_OPTIONS) is False


def test_every_size_up_to_the_switch_and_past_it_signs_alike() -> None:
    seed = os.urandom(32)
    handle = ED25519.load(seed)
    reference = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    data = os.urandom(SODIUM_MAX_MESSAGE + 64)
    for size in range(SODIUM_MAX_MESSAGE - 64, SODIUM_MAX_MESSAGE + 65):
        message = data[:size]
        assert handle.sign(message, prehashed=False, options=NO_OPTIONS) == reference.sign(message)


def test_public_key_is_pycas_and_libsodiums() -> None:
    for seed in _seeds():
        pem = ED25519.load(seed).public_key_pem()
        assert pem is not None
        public = ed25519.Ed25519PrivateKey.from_private_bytes(seed).public_key()
        assert pem.encode() == public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert crypto_sign_seed_keypair(seed)[0] == public.public_bytes_raw()


def test_generated_and_imported_material_is_the_seed() -> None:
    material = ED25519.generate()
    assert len(material) == 32
    private = ed25519.Ed25519PrivateKey.from_private_bytes(material)
    pkcs8 = private.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert ED25519.import_key is not None
    assert ED25519.import_key(pkcs8) == material
    message = os.urandom(100)
    signature = ED25519.load(material).sign(message, prehashed=False, options=NO_OPTIONS)
    private.public_key().verify(signature, message)


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_material_of_another_length_is_refused(size: int) -> None:
    with pytest.raises(InvalidKeyMaterial):
        ED25519.load(os.urandom(size))


def test_digest_and_options_are_refused_on_both_paths() -> None:
    handle = ED25519.load(os.urandom(32))
    for size in (32, SODIUM_MAX_MESSAGE + 1):
        message = os.urandom(size)
        with pytest.raises(InvalidOptions):
            handle.sign(message, prehashed=True, options=NO_OPTIONS)
        with pytest.raises(InvalidOptions):
            handle.sign(message, prehashed=False, options=SignOptions(hash_algorithm="sha2-256"))


def test_handle_refuses_pickling_and_shows_no_key() -> None:
    # Pool workers load the keyring themselves: a handle never crosses a process boundary.
    seed = os.urandom(32)
    handle = ED25519.load(seed)
    assert isinstance(handle, Ed25519Key)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(handle)
    assert repr(handle) == "<Ed25519Key ed25519>"
    assert seed.hex() not in repr(handle)
