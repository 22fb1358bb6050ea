"""AES-256-GCM and SM4-GCM with 96-bit random nonces.

Body layout: nonce(12) || ciphertext || tag(16).
"""

from __future__ import annotations

import os
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service.crypto.base import InvalidCiphertext

NONCE_SIZE = 12
TAG_SIZE = 16


class Aead(Protocol):
    """Authenticated encryption. ``seal`` picks a fresh random nonce; ``seal_with_nonce`` takes
    one the caller guarantees unique for distinct inputs (convergent encryption); ``open``
    raises InvalidCiphertext for any failure."""

    def seal(self, plaintext: bytes, associated_data: bytes) -> bytes: ...
    def seal_with_nonce(self, nonce: bytes, plaintext: bytes, associated_data: bytes) -> bytes: ...
    def open(self, body: bytes, associated_data: bytes) -> bytes: ...


class AesGcm:
    """AES-GCM; the AESGCM object is built once per key and reused."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if len(key) not in (16, 32):
            raise ValueError("AES-GCM key must be 128 or 256 bits")
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, associated_data: bytes) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._aead.encrypt(nonce, plaintext, associated_data)

    def seal_with_nonce(self, nonce: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
        return nonce + self._aead.encrypt(nonce, plaintext, associated_data)

    def open(self, body: bytes, associated_data: bytes) -> bytes:
        if len(body) < NONCE_SIZE + TAG_SIZE:
            raise InvalidCiphertext
        try:
            return self._aead.decrypt(body[:NONCE_SIZE], body[NONCE_SIZE:], associated_data)
        except InvalidTag:
            raise InvalidCiphertext from None


class Sm4Gcm:
    """SM4-GCM (GB/T 32907 block cipher in GCM mode) through pyca/cryptography's Cipher API."""

    __slots__ = ("_algorithm",)

    def __init__(self, key: bytes) -> None:
        self._algorithm = algorithms.SM4(key)

    def seal(self, plaintext: bytes, associated_data: bytes) -> bytes:
        return self.seal_with_nonce(os.urandom(NONCE_SIZE), plaintext, associated_data)

    def seal_with_nonce(self, nonce: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
        encryptor = Cipher(self._algorithm, modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(associated_data)
        ciphertext = encryptor.update(plaintext) + encryptor.finalize()
        return nonce + ciphertext + encryptor.tag

    def open(self, body: bytes, associated_data: bytes) -> bytes:
        if len(body) < NONCE_SIZE + TAG_SIZE:
            raise InvalidCiphertext
        nonce, ciphertext, tag = body[:NONCE_SIZE], body[NONCE_SIZE:-TAG_SIZE], body[-TAG_SIZE:]
        decryptor = Cipher(self._algorithm, modes.GCM(nonce, tag)).decryptor()
        decryptor.authenticate_additional_data(associated_data)
        try:
            return decryptor.update(ciphertext) + decryptor.finalize()
        except InvalidTag:
            raise InvalidCiphertext from None
