"""Interfaces of the crypto layer: bytes in, bytes out, no HTTP, no I/O.

Every key type provides a :class:`KeyType` (how to generate, import and load its material) and a
:class:`KeyHandle` (what a parsed key can do). Handles refuse pickling: key material never crosses
a process boundary by accident; pool workers load the keyring themselves.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NoReturn

Operation = Literal["encrypt", "decrypt", "sign", "verify", "hmac", "encapsulate", "decapsulate"]


class CryptoError(Exception):
    """Base of the crypto layer's errors."""


class InvalidCiphertext(CryptoError):
    """Decryption failed. Deliberately says nothing about which check failed."""

    def __init__(self) -> None:
        super().__init__("decryption failed")


class UnsupportedOperation(CryptoError):
    """The key type does not support this operation."""


class InvalidOptions(CryptoError):
    """Options that do not apply to this key type, or bad values for it (safe to show a client)."""


class InvalidKeyMaterial(CryptoError):
    """Key material that cannot be imported (safe to show: says nothing of the key's bytes)."""


@dataclass(frozen=True, slots=True)
class SignOptions:
    """Per-request signing options. ``None`` means "not sent": each key type rejects options
    that do not apply to it, so a client learns of a mistake instead of getting a default."""

    algorithm: str | None = None  # RSA: "pss" (default) or "pkcs1v15"
    encoding: str | None = None  # ECDSA and SM2: "der" (default) or "raw" (fixed-length r||s)
    signer_id: bytes | None = None  # SM2 only; default b"1234567812345678"
    hash_algorithm: str | None = None  # RSA and ECDSA: "sha2-256" | "sha2-384" | "sha2-512"
    context: bytes | None = None  # ML-DSA only: 0-255 bytes (FIPS 204 ctx)
    message_type: str | None = None  # ML-DSA only: "raw" (default) or "external_mu"

    def refuse(self, *names: str) -> None:
        """Raise InvalidOptions if any of ``names`` was sent."""
        if self is NO_OPTIONS:  # nothing was sent (the usual request): nothing to look at
            return
        for name in names:
            if getattr(self, name) is not None:
                raise InvalidOptions(f"'{name}' does not apply to this key type")

    def raw_encoding(self, *refused: str) -> bool:
        """ECDSA and SM2, once the options in ``refused`` are refused: whether the signature
        is fixed-length r||s (``"raw"``) rather than DER (``"der"``, the default)."""
        self.refuse(*refused)
        if self.encoding in (None, "der"):
            return False
        if self.encoding == "raw":
            return True
        raise InvalidOptions("encoding must be 'der' or 'raw'")


# No option sent: requests without options share this one (built once, checked at a glance).
NO_OPTIONS = SignOptions()


class KeyHandle(ABC):
    """A parsed key version. Methods a type does not support raise UnsupportedOperation."""

    type_name: ClassVar[str]

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        """Return the ciphertext body (no cryptd token framing)."""
        self._unsupported("encrypt")

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        """Inverse of encrypt; raises InvalidCiphertext on any failure."""
        self._unsupported("decrypt")

    def decrypt_external(self, ciphertext: bytes, fmt: str) -> bytes:
        """Decrypt ciphertext made by another tool with this key's public key."""
        self._unsupported("decrypt")

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        """Sign a message, or its digest when ``prehashed``."""
        self._unsupported("sign")

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        """True when the signature verifies; False for any signature bytes that do not."""
        self._unsupported("verify")

    def encapsulate(self) -> tuple[bytes, bytes]:
        """KEM keys: a fresh (ciphertext, shared secret) for this key's public key."""
        self._unsupported("encapsulate")

    def decapsulate(self, ciphertext: bytes) -> bytes:
        """KEM keys: the shared secret of ``ciphertext``. A ciphertext of the right length made
        for another key yields another secret (implicit rejection), never an error; one of the
        wrong length raises InvalidOptions."""
        self._unsupported("decapsulate")

    def mac(self, message: bytes) -> bytes:
        """The MAC tag of ``message`` (HMAC keys)."""
        self._unsupported("hmac")

    def verify_mac(self, tag: bytes, message: bytes) -> bool:
        """True when ``tag`` is the MAC of ``message``, compared in constant time; False for
        any other bytes."""
        self._unsupported("verify a MAC")

    def for_context(self, context: bytes) -> KeyHandle:
        """The key derived for ``context`` (derived keys only)."""
        raise InvalidOptions("'context' applies to derived keys only; this key is not derived")

    def public_key_pem(self) -> str | None:
        """SubjectPublicKeyInfo PEM for asymmetric keys; None for secret keys."""
        return None

    def public_key_raw(self) -> str | None:
        """Raw public key encoding where one is customary (SM2: hex 04||x||y)."""
        return None

    def _unsupported(self, operation: str) -> NoReturn:
        raise UnsupportedOperation(f"key type {self.type_name} does not support {operation}")

    def __getstate__(self) -> NoReturn:
        raise TypeError("key handles cannot be pickled")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.type_name}>"


@dataclass(frozen=True)
class KeyType:
    """A key type: its token id, what it supports, and how its material is made and parsed.

    ``material`` is the serialized secret (raw bytes for symmetric keys, PKCS#8 DER or a raw
    scalar for private keys). ``load`` may skip expensive validation: material is only ever
    loaded after the keyring authenticated it under the master key. ``import_key`` validates
    untrusted input fully. ``derive`` (types that support derived keys) loads a version whose
    every operation takes a context: ``derive(material, binding, convergent)``, where
    ``binding`` names the key and version (see ``service.crypto.derived``).
    """

    name: str
    type_id: int
    operations: frozenset[Operation]
    asymmetric: bool
    generate: Callable[[], bytes]
    load: Callable[[bytes], KeyHandle]
    import_key: Callable[[bytes], bytes] | None = None
    external_formats: frozenset[str] = field(default_factory=frozenset)
    sign_digest_size: int | None = None  # default digest size; None: digests refused
    derive: Callable[[bytes, bytes, bool], KeyHandle] | None = None
    convergent: bool = False  # derived keys of this type may be convergent
    # Sign options ``context`` and ``message_type`` apply (ML-DSA); other types refuse them.
    signing_context: bool = False
    # HPKE types: the token's associated data is the request's aad alone (not cryptd's binding
    # of key name, version and type), so any HPKE library can encrypt to the public key.
    hpke: bool = False

    def supports(self, operation: Operation) -> bool:
        return operation in self.operations
