"""SM2 keys (GB/T 32918): hybrid encryption - SM2 public-key encryption (C1C3C2) wraps a fresh
SM4-GCM data key - and SM2 signatures with SM3 and the Z value (GB/T 32918.2, GM/T 0009).

The SM2 operations run in the system libcrypto (see ``_libcrypto``); SM3 and SM4-GCM come from
pyca/cryptography. Python only chooses, encodes and checks.

Keyring material: the 32-byte big-endian private scalar d, 1 <= d <= n - 2. The public key is
derived by libcrypto when the key is loaded.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import ClassVar, Final

from service.crypto import _sm2_codec as codec
from service.crypto import hybrid
from service.crypto._libcrypto import LibcryptoError, Sm2PrivateKey, Sm2PublicKey, available
from service.crypto.aead import Sm4Gcm
from service.crypto.base import (
    InvalidCiphertext,
    InvalidKeyMaterial,
    InvalidOptions,
    KeyHandle,
    KeyType,
    Operation,
    SignOptions,
)
from service.crypto.sm3 import sm3

__all__ = [
    "DEFAULT_SIGNER_ID",
    "SM2",
    "Sm2Key",
    "Sm2Verifier",
    "available",
    "compute_z",
    "generate",
    "import_key",
    "load",
    "load_public_pem",
    "message_digest",
]

DEFAULT_SIGNER_ID: Final = b"1234567812345678"  # GM/T 0009-2012 section 10
MAX_SIGNER_ID: Final = 255  # the service's limit; the algorithm allows 8191 bytes
DEK_SIZE: Final = 16  # SM4 key
DIGEST_SIZE: Final = 32  # e = SM3(Z || M)
EXTERNAL_FORMATS: Final = frozenset({"sm2", "sm2-c1c2c3"})
_MAX_DER_SIGNATURE = 72
_CURVE_FOR_Z = b"".join(
    v.to_bytes(codec.SIZE, "big") for v in (codec.A, codec.B, codec.GX, codec.GY)
)


def compute_z(public_point: bytes, signer_id: bytes = DEFAULT_SIGNER_ID) -> bytes:
    """Z = SM3(ENTL || ID || a || b || xG || yG || xA || yA) (GB/T 32918.2 section 5.5).

    ``public_point`` is 04 || x || y (or x || y)."""
    xy = public_point  # x || y; by length, since x itself may start with 0x04
    if len(public_point) == 2 * codec.SIZE + 1 and public_point[:1] == codec.POINT_PREFIX:
        xy = public_point[1:]
    if len(xy) != 2 * codec.SIZE:
        raise ValueError("public point must be 04 || x || y or x || y")
    if len(signer_id) > 8191:
        raise ValueError("SM2 signer ID is limited to 8191 bytes")
    entl = (8 * len(signer_id)).to_bytes(2, "big")
    return sm3(entl, signer_id, _CURVE_FOR_Z, xy)


def message_digest(
    public_point: bytes, message: bytes, signer_id: bytes = DEFAULT_SIGNER_ID
) -> bytes:
    """e = SM3(Z || M): what a client sends as ``digest`` to have ``message`` signed."""
    return sm3(compute_z(public_point, signer_id), message)


# --- the key handle ---------------------------------------------------------------------------


class Sm2Key(KeyHandle):
    type_name: ClassVar[str] = "sm2"
    __slots__ = ("_default_z", "_key", "_pem", "_point")

    def __init__(self, key: Sm2PrivateKey) -> None:
        self._key = key
        self._point = key.public_point()
        self._pem = _pem("PUBLIC KEY", key.public_key_der())
        self._default_z = compute_z(self._point, DEFAULT_SIGNER_ID)

    # encryption

    def encrypt(self, plaintext: bytes, associated_data: bytes) -> bytes:
        return hybrid.seal(
            plaintext, associated_data, dek_size=DEK_SIZE, wrap=self.encrypt_raw, aead=Sm4Gcm
        )

    def decrypt(self, body: bytes, associated_data: bytes) -> bytes:
        return hybrid.open_(
            body, associated_data, dek_size=DEK_SIZE, unwrap=self._unwrap, aead=Sm4Gcm
        )

    def encrypt_raw(self, plaintext: bytes) -> bytes:
        """Plain SM2 public-key encryption: C1C3C2 with the 0x04 prefix (the hybrid wrap).

        SM2 has no encryption of an empty message (C2 would be empty): ValueError."""
        if not plaintext:
            raise ValueError("SM2 cannot encrypt an empty message")
        reading = codec.parse_der(self._key.encrypt(plaintext))
        if reading is None:
            raise LibcryptoError("libcrypto: unexpected SM2 ciphertext encoding")
        return reading.to_c1c3c2()

    def decrypt_external(self, ciphertext: bytes, fmt: str) -> bytes:
        if fmt not in EXTERNAL_FORMATS:
            raise InvalidOptions("format must be 'sm2' or 'sm2-c1c2c3' for SM2 keys")
        return self._decrypt_first(codec.candidates(ciphertext, fmt))

    def _unwrap(self, wrapped: bytes) -> bytes:
        reading = codec.parse_c1c3c2(wrapped, prefix=True)
        return self._decrypt_first([] if reading is None else [reading])

    def _decrypt_first(self, readings: list[codec.Sm2Ciphertext]) -> bytes:
        # libcrypto checks C1 is on the curve and compares C3 in constant time; the first
        # reading that passes is the right one (a wrong split fails C3 but for 2^-256).
        for reading in readings:
            plaintext = self._key.decrypt(reading.to_der())
            if plaintext is not None:
                return plaintext
        raise InvalidCiphertext

    # signatures

    def _digest(self, data: bytes, prehashed: bool, options: SignOptions) -> bytes:
        """e = SM3(Z || M), or the client's e. Hashing here rather than in EVP_DigestSign saves
        libcrypto's per-call digest setup (~8% of a signature) and gives messages and digests
        one code path; pyca/cryptography hashes large inputs without the GIL."""
        if prehashed:
            # The signer ID is already inside e; accepting one would silently do nothing.
            options.refuse("signer_id")
            if len(data) != DIGEST_SIZE:
                raise InvalidOptions(f"an SM2 digest is e = SM3(Z || M), {DIGEST_SIZE} bytes")
            return data
        if options.signer_id is None:
            z = self._default_z
        elif len(options.signer_id) > MAX_SIGNER_ID:
            raise InvalidOptions(f"signer_id must be at most {MAX_SIGNER_ID} bytes")
        else:
            z = compute_z(self._point, options.signer_id)
        return sm3(z, data)

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        raw = options.raw_encoding("algorithm", "hash_algorithm")
        signature = self._key.sign_digest(self._digest(data, prehashed, options))
        if not raw:
            return signature
        converted = codec.signature_to_raw(signature)
        if converted is None:
            raise LibcryptoError("libcrypto: unexpected SM2 signature encoding")
        return converted

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        raw = options.raw_encoding("algorithm", "hash_algorithm")
        digest = self._digest(data, prehashed, options)
        der = codec.signature_to_der(signature) if raw else signature
        if der is None or len(der) > _MAX_DER_SIGNATURE:
            return False
        # libcrypto insists on strict DER (it re-encodes and compares) and 1 <= r, s < n.
        return self._key.verify_digest(der, digest)

    # public key

    def public_key_pem(self) -> str:
        return self._pem

    def public_key_raw(self) -> str:
        return self._point.hex()

    @property
    def public_point(self) -> bytes:
        """04 || x || y."""
        return self._point


# --- material ---------------------------------------------------------------------------------


class Sm2Verifier:
    """An SM2 public key alone: verifies DER signatures over messages made with the default
    signer ID (what :meth:`Sm2Key.sign` makes without options)."""

    __slots__ = ("_key", "_z")

    def __init__(self, key: Sm2PublicKey) -> None:
        self._key = key
        self._z = compute_z(key.public_point(), DEFAULT_SIGNER_ID)

    def verify(self, signature: bytes, message: bytes) -> bool:
        if len(signature) > _MAX_DER_SIGNATURE:
            return False
        return self._key.verify_digest(signature, sm3(self._z, message))


def load_public_pem(text: str) -> Sm2Verifier | None:
    """A ``PUBLIC KEY`` PEM (SubjectPublicKeyInfo) as an SM2 verifier; None if it is not an
    SM2 public key."""
    match = re.fullmatch(
        r"\s*-----BEGIN PUBLIC KEY-----([A-Za-z0-9+/=\s]+)-----END PUBLIC KEY-----\s*", text
    )
    if match is None:
        return None
    try:
        der = base64.b64decode("".join(match.group(1).split()), validate=True)
    except binascii.Error:
        return None
    key = Sm2PublicKey.decode_public(der)
    return None if key is None else Sm2Verifier(key)


def _check_scalar(scalar: bytes) -> None:
    value = int.from_bytes(scalar, "big")
    if len(scalar) != codec.SIZE or not 1 <= value <= codec.N - 2:
        raise InvalidKeyMaterial("SM2 private key out of range [1, n-2]")


def generate() -> bytes:
    """A fresh key pair from libcrypto's DRBG; returns the material (the private scalar)."""
    scalar = Sm2PrivateKey.generate().scalar()
    _check_scalar(scalar)
    return scalar


def load(material: bytes) -> Sm2Key:
    """Parse keyring material (already authenticated under the master key)."""
    if len(material) != codec.SIZE:
        raise InvalidKeyMaterial("SM2 material must be a 32-byte private scalar")
    _check_scalar(material)  # libcrypto would take 0 and give the point at infinity
    der = codec.sec1_private_key(material)
    try:
        key = Sm2PrivateKey.decode(der, "type-specific")
    finally:
        der[:] = bytes(len(der))
    if key is None:
        raise InvalidKeyMaterial("material is not an SM2 private key")
    return Sm2Key(key)


_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\s*?\n(.*?)-----END \1-----", re.DOTALL)
_PRIVATE_LABELS = {
    b"PRIVATE KEY": "PrivateKeyInfo",  # PKCS#8
    b"EC PRIVATE KEY": "type-specific",  # RFC 5915 (openssl ecparam -genkey, GmSSL, BC)
    b"SM2 PRIVATE KEY": "type-specific",  # RFC 5915 as written by OpenSSL 3 `openssl ec`
}
_IGNORED_LABELS = {b"EC PARAMETERS", b"SM2 PARAMETERS"}  # `openssl ecparam -genkey` adds one
_HEX_SCALAR = re.compile(rb"[0-9A-Fa-f]{64}")


def import_key(data: bytes) -> bytes:
    """Validate an existing SM2 private key and return its material.

    Accepts PEM (PKCS#8 ``PRIVATE KEY``, or RFC 5915 ``EC PRIVATE KEY`` / ``SM2 PRIVATE KEY`` on
    the SM2 curve), DER PKCS#8, or the private scalar as 64 hex digits. Errors never quote the
    input."""
    text = data.strip()
    if text.startswith(b"-----BEGIN"):
        structure, der = _private_pem(text)
        return _import_der(der, structure)
    if _HEX_SCALAR.fullmatch(text):
        scalar = bytes.fromhex(text.decode("ascii"))
        _check_scalar(scalar)
        load(scalar)
        return scalar
    if data[:1] == b"\x30":
        return _import_der(data, "PrivateKeyInfo")
    raise InvalidKeyMaterial(
        "expected an unencrypted PEM or DER private key, or a 64-digit hex SM2 private key"
    )


def _private_pem(text: bytes) -> tuple[str, bytes]:
    blocks = [
        (label, body) for label, body in _PEM_BLOCK.findall(text) if label not in _IGNORED_LABELS
    ]
    if len(blocks) != 1:
        raise InvalidKeyMaterial("expected exactly one PEM private key block")
    label, body = blocks[0]
    if label == b"ENCRYPTED PRIVATE KEY" or b"Proc-Type:" in body:
        raise InvalidKeyMaterial("encrypted private keys are not supported; decrypt it first")
    if label not in _PRIVATE_LABELS:
        raise InvalidKeyMaterial(
            "expected a PEM 'PRIVATE KEY', 'EC PRIVATE KEY' or 'SM2 PRIVATE KEY' block"
        )
    try:
        der = base64.b64decode(b"".join(body.split()), validate=True)
    except binascii.Error:
        raise InvalidKeyMaterial("PEM body is not valid base64") from None
    return _PRIVATE_LABELS[label], der


def _import_der(der: bytes, structure: str) -> bytes:
    key = Sm2PrivateKey.decode(der, structure)
    if key is None:
        raise InvalidKeyMaterial("not an unencrypted private key on the SM2 curve")
    if not key.check():
        raise InvalidKeyMaterial("SM2 private key failed validation")
    scalar = key.scalar()
    _check_scalar(scalar)
    return scalar


def _pem(label: str, der: bytes) -> str:
    body = base64.b64encode(der).decode("ascii")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----\n"


_OPERATIONS: frozenset[Operation] = frozenset({"encrypt", "decrypt", "sign", "verify"})

SM2 = KeyType(
    name="sm2",
    type_id=8,
    operations=_OPERATIONS,
    asymmetric=True,
    generate=generate,
    load=load,
    import_key=import_key,
    external_formats=EXTERNAL_FORMATS,
    sign_digest_size=DIGEST_SIZE,
)
