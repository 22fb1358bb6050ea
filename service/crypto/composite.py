"""Composite ML-DSA signatures: ML-DSA-65 and a traditional signature over one message
representative; a signature verifies only if both parts do. The construction, the encodings and
the two standard algorithms are those of draft-ietf-lamps-pq-composite-sigs-19 (IETF LAMPS,
April 2026); ``ml-dsa-65-sm2`` is cryptd's own instance of the same construction.

For a message M and an application context ctx (0-255 bytes, empty by default):

    M'        = Prefix || Label || len(ctx) || ctx || SHA-512(M)
    signature = ML-DSA-65.Sign(seed, M', ctx=Label) || Trad.Sign(M')

Prefix is the ASCII "CompositeAlgorithmSignatures2025" for all three types. The ML-DSA half is
pure ML-DSA (FIPS 204 Algorithm 2) with the label as its context; the traditional half signs M'
as the component algorithm always does:

- ``ml-dsa-65-ecdsa-p256``: id-MLDSA65-ECDSA-P256-SHA512 (1.3.6.1.5.5.7.6.45), label
  COMPSIG-MLDSA65-ECDSA-P256-SHA512; ECDSA P-256 with SHA-256, DER.
- ``ml-dsa-65-ed25519``: id-MLDSA65-Ed25519-SHA512 (1.3.6.1.5.5.7.6.48), label
  COMPSIG-MLDSA65-Ed25519-SHA512; Ed25519.
- ``ml-dsa-65-sm2``: no OID (cryptd's own), label CRYPTD-COMPSIG-MLDSA65-SM2-SHA512 (outside the
  draft's COMPSIG- names, so no algorithm it defines shares an M'); SM2 with SM3, signer ID
  1234567812345678, DER.

Encodings (draft section 4): public key mldsaPK (1,952 bytes) || traditional public key (the
uncompressed point 04||x||y for ECDSA and SM2, the 32 raw bytes for Ed25519); private key
mldsaSeed (32) || traditional private key (RFC 5915 ECPrivateKey without the public key for
ECDSA, the 32-byte seed for Ed25519; for SM2 the 32-byte scalar), which is also the keyring
material; signature mldsaSig (3,309 bytes) || traditional signature. The two draft types give
their public key as a SubjectPublicKeyInfo under the composite OID; ``ml-dsa-65-sm2`` has no
OID, so its PEM block is labelled ``ML-DSA-65-SM2 PUBLIC KEY`` and holds the bare composite key.

``external_mu`` does not apply (mu is ML-DSA's own message representative; M' is the
composite's), nor does a ``digest``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, mldsa

from service.crypto import _sm2_codec as der
from service.crypto import sm2
from service.crypto.base import (
    NO_OPTIONS,
    InvalidKeyMaterial,
    InvalidOptions,
    KeyHandle,
    KeyType,
    SignOptions,
)
from service.crypto.ecdsa import EcdsaKey
from service.crypto.ed25519 import Ed25519Key
from service.crypto.mldsa import MAX_CONTEXT
from service.crypto.pkcs8 import load_untrusted

DRAFT: Final = "draft-ietf-lamps-pq-composite-sigs-19"
PREFIX: Final = b"CompositeAlgorithmSignatures2025"
SEED_SIZE: Final = 32
MLDSA_SIGNATURE_SIZE: Final = 3309
_SEQUENCE, _INTEGER, _OCTET_STRING, _OID, _BIT_STRING = 0x30, 0x02, 0x04, 0x06, 0x03
_P256_OID = bytes.fromhex("06082a8648ce3d030107")  # prime256v1, DER encoded


def representative(label: bytes, context: bytes, message: bytes) -> bytes:
    """M' = Prefix || Label || len(ctx) || ctx || SHA-512(M) (draft section 2.2)."""
    digest = hashes.Hash(hashes.SHA512())
    digest.update(message)
    return PREFIX + label + bytes([len(context)]) + context + digest.finalize()


# --- the traditional halves -------------------------------------------------------------------


@dataclass(frozen=True)
class Traditional:
    """What a composite needs of its traditional algorithm: its key from the private key
    encoding (the handle and the public key encoding), a fresh private key, and the canonical
    private key encoding of an imported one."""

    load: Callable[[bytes], tuple[KeyHandle, bytes]]
    generate: Callable[[], bytes]
    canonical: Callable[[bytes], bytes]


def _ec_private_key(scalar: bytes) -> bytes:
    """RFC 5915 ECPrivateKey on P-256 without the public key: the draft's ECDSA encoding."""
    parameters = der.tlv(0xA0, _P256_OID)
    return der.tlv(
        _SEQUENCE, der.tlv(_INTEGER, b"\x01") + der.tlv(_OCTET_STRING, scalar) + parameters
    )


_EC_HEAD, _EC_TAIL = _ec_private_key(bytes(32)).split(bytes(32))


def _ecdsa_load(encoded: bytes) -> tuple[KeyHandle, bytes]:
    # Keyring material is always the canonical form cryptd wrote: a fixed frame round a scalar.
    if len(encoded) != len(_EC_HEAD) + 32 + len(_EC_TAIL) or not (
        encoded.startswith(_EC_HEAD) and encoded.endswith(_EC_TAIL)
    ):
        raise InvalidKeyMaterial("not a composite ECDSA P-256 private key")
    scalar = int.from_bytes(encoded[len(_EC_HEAD) : -len(_EC_TAIL)], "big")
    try:
        private = ec.derive_private_key(scalar, ec.SECP256R1())
    except ValueError:
        raise InvalidKeyMaterial("composite ECDSA P-256 private key out of range") from None
    public = private.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    return EcdsaKey("ecdsa-p256", private, scalar=32, default_hash="sha2-256"), public


def _ecdsa_generate() -> bytes:
    private = ec.generate_private_key(ec.SECP256R1())
    return _ec_private_key(private.private_numbers().private_value.to_bytes(32, "big"))


def _ecdsa_canonical(encoded: bytes) -> bytes:
    """Any ECPrivateKey (or PKCS#8) on P-256 pyca parses, as the draft's encoding."""
    key = load_untrusted(encoded)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise InvalidKeyMaterial("the traditional part is not a P-256 private key")
    return _ec_private_key(key.private_numbers().private_value.to_bytes(32, "big"))


def _ed25519_load(encoded: bytes) -> tuple[KeyHandle, bytes]:
    if len(encoded) != 32:
        raise InvalidKeyMaterial("the composite Ed25519 private key is a 32-byte seed")
    public = ed25519.Ed25519PrivateKey.from_private_bytes(encoded).public_key()
    return Ed25519Key(encoded), public.public_bytes_raw()


def _ed25519_canonical(encoded: bytes) -> bytes:
    _ed25519_load(encoded)
    return bytes(encoded)


def _sm2_load(encoded: bytes) -> tuple[KeyHandle, bytes]:
    key = sm2.load(encoded)
    return key, key.public_point


def _sm2_canonical(encoded: bytes) -> bytes:
    _sm2_load(encoded)  # checks 1 <= d <= n - 2 and that libcrypto takes it
    return bytes(encoded)


ECDSA_P256_HALF = Traditional(_ecdsa_load, _ecdsa_generate, _ecdsa_canonical)
ED25519_HALF = Traditional(
    _ed25519_load,
    lambda: ed25519.Ed25519PrivateKey.generate().private_bytes_raw(),
    _ed25519_canonical,
)
SM2_HALF = Traditional(_sm2_load, sm2.generate, _sm2_canonical)


# --- the composite ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Composite:
    """One composite algorithm: its label, its OID (None: cryptd's own) and its halves."""

    name: str
    label: bytes
    oid: str | None
    traditional: Traditional

    def algorithm_identifier(self) -> bytes:
        """AlgorithmIdentifier { the composite OID }, parameters absent (draft sections 5.3, 6)."""
        assert self.oid is not None
        first, second, *rest = (int(arc) for arc in self.oid.split("."))
        body = bytes([40 * first + second])
        for arc in rest:  # base 128, high bit set on every octet but the last
            chunk = [arc & 0x7F]
            while arc > 0x7F:
                arc >>= 7
                chunk.append(0x80 | (arc & 0x7F))
            body += bytes(reversed(chunk))
        return der.tlv(_SEQUENCE, der.tlv(_OID, body))

    def spki(self, public: bytes) -> bytes:
        """SubjectPublicKeyInfo: the composite public key in the BIT STRING, unwrapped."""
        bits = der.tlv(_BIT_STRING, b"\x00" + public)
        return der.tlv(_SEQUENCE, self.algorithm_identifier() + bits)

    def pem(self, public: bytes) -> str:
        if self.oid is None:
            label, body = f"{self.name.upper()} PUBLIC KEY", public
        else:
            label, body = "PUBLIC KEY", self.spki(public)
        text = base64.b64encode(body).decode("ascii")
        lines = "\n".join(text[i : i + 64] for i in range(0, len(text), 64))
        return f"-----BEGIN {label}-----\n{lines}\n-----END {label}-----\n"


class CompositeKey(KeyHandle):
    __slots__ = ("_composite", "_mldsa", "_mldsa_public", "_public", "_trad", "type_name")

    def __init__(self, composite: Composite, material: bytes) -> None:
        self.type_name = composite.name  # type: ignore[misc]  # one class serves the three types
        self._composite = composite
        if len(material) <= SEED_SIZE:
            raise InvalidKeyMaterial(f"{composite.name} material is too short")
        self._mldsa = mldsa.MLDSA65PrivateKey.from_seed_bytes(material[:SEED_SIZE])
        self._mldsa_public = self._mldsa.public_key()
        self._trad, trad_public = composite.traditional.load(material[SEED_SIZE:])
        self._public = self._mldsa_public.public_bytes_raw() + trad_public

    def _representative(self, data: bytes, prehashed: bool, options: SignOptions) -> bytes:
        options.refuse("algorithm", "encoding", "signer_id", "hash_algorithm")
        if prehashed:
            raise InvalidOptions(f"{self.type_name} signs messages only; 'digest' is not accepted")
        if options.message_type not in (None, "raw"):
            raise InvalidOptions(
                f"message_type must be 'raw' for {self.type_name}: external_mu is ML-DSA's own"
            )
        context = options.context or b""
        if len(context) > MAX_CONTEXT:
            raise InvalidOptions("context must be at most 255 bytes")
        return representative(self._composite.label, context, data)

    def sign(self, data: bytes, *, prehashed: bool, options: SignOptions) -> bytes:
        message = self._representative(data, prehashed, options)
        first = self._mldsa.sign(message, self._composite.label)
        return first + self._trad.sign(message, prehashed=False, options=NO_OPTIONS)

    def verify(
        self, signature: bytes, data: bytes, *, prehashed: bool, options: SignOptions
    ) -> bool:
        message = self._representative(data, prehashed, options)
        if len(signature) <= MLDSA_SIGNATURE_SIZE:
            return False
        first, second = signature[:MLDSA_SIGNATURE_SIZE], signature[MLDSA_SIGNATURE_SIZE:]
        try:
            self._mldsa_public.verify(first, message, self._composite.label)
        except (InvalidSignature, ValueError):
            return False
        # Both halves must verify; the public key's check needs no constant time.
        return self._trad.verify(second, message, prehashed=False, options=NO_OPTIONS)

    def public_key_pem(self) -> str:
        return self._composite.pem(self._public)

    def public_key_raw(self) -> str:
        """The composite public key (mldsaPK || traditional public key), hex."""
        return self._public.hex()


# --- import -----------------------------------------------------------------------------------


def _pkcs8_private_key(data: bytes, composite: Composite) -> tuple[bytes, bytes | None] | None:
    """The privateKey octets and the publicKey BIT STRING content (if any) of a
    OneAsymmetricKey (RFC 5958, DER or PEM) under the composite OID, or None when ``data`` is
    not one (then it is read as the bare composite key)."""
    if composite.oid is None:
        return None
    text = data.strip()
    if text.startswith(b"-----BEGIN PRIVATE KEY-----"):
        body = text[len(b"-----BEGIN PRIVATE KEY-----") :]
        end = body.find(b"-----END PRIVATE KEY-----")
        if end < 0:
            raise InvalidKeyMaterial("the PEM 'PRIVATE KEY' block is not closed")
        try:
            data = base64.b64decode(b"".join(body[:end].split()), validate=True)
        except ValueError:
            raise InvalidKeyMaterial("the PEM body is not valid base64") from None
    outer = der.read_tlv(data, 0, _SEQUENCE)
    if outer is None or outer[1] != len(data):
        if text.startswith(b"-----BEGIN"):
            raise InvalidKeyMaterial("not a composite PKCS#8 private key")
        return None
    body = outer[0]
    version = der.read_tlv(body, 0, _INTEGER)
    algorithm = version and der.read_tlv(body, version[1], _SEQUENCE)
    private = algorithm and der.read_tlv(body, algorithm[1], _OCTET_STRING)
    if not (version and algorithm and private) or version[0] not in (b"\x00", b"\x01"):
        return None
    if der.tlv(_SEQUENCE, algorithm[0]) != composite.algorithm_identifier():
        raise InvalidKeyMaterial("a PKCS#8 key of another algorithm")
    # Then attributes [0] and, in version 1, the public key [1], nothing else.
    attributes = der.read_tlv(body, private[1], 0xA0)
    position = private[1] if attributes is None else attributes[1]
    public = der.read_tlv(body, position, 0x81) if version[0] == b"\x01" else None
    if (position if public is None else public[1]) != len(body):
        raise InvalidKeyMaterial("not a composite PKCS#8 private key")
    return private[0], None if public is None else public[0]


def _import(composite: Composite, data: bytes) -> bytes:
    found = _pkcs8_private_key(data, composite)
    encoded, public = (bytes(data), None) if found is None else found
    if len(encoded) <= SEED_SIZE:
        raise InvalidKeyMaterial(
            f"{composite.name} imports mldsaSeed (32 bytes) || the traditional private key"
        )
    material = encoded[:SEED_SIZE] + composite.traditional.canonical(encoded[SEED_SIZE:])
    handle = CompositeKey(composite, material)
    # A publicKey that the private key does not give: a mangled or mismatched key, refused.
    if public is not None and public != b"\x00" + bytes.fromhex(handle.public_key_raw()):
        raise InvalidKeyMaterial("the PKCS#8 public key is not the private key's")
    return material


def _composite_type(composite: Composite, type_id: int) -> KeyType:
    return KeyType(
        name=composite.name,
        type_id=type_id,
        operations=frozenset({"sign", "verify"}),
        asymmetric=True,
        generate=lambda: (
            mldsa.MLDSA65PrivateKey.generate().private_bytes_raw()
            + composite.traditional.generate()
        ),
        load=lambda material: CompositeKey(composite, material),
        import_key=lambda data: _import(composite, data),
        signing_context=True,
    )


MLDSA65_ECDSA_P256 = Composite(
    "ml-dsa-65-ecdsa-p256",
    b"COMPSIG-MLDSA65-ECDSA-P256-SHA512",
    "1.3.6.1.5.5.7.6.45",
    ECDSA_P256_HALF,
)
MLDSA65_ED25519 = Composite(
    "ml-dsa-65-ed25519", b"COMPSIG-MLDSA65-Ed25519-SHA512", "1.3.6.1.5.5.7.6.48", ED25519_HALF
)
MLDSA65_SM2 = Composite("ml-dsa-65-sm2", b"CRYPTD-COMPSIG-MLDSA65-SM2-SHA512", None, SM2_HALF)

ML_DSA_65_ECDSA_P256 = _composite_type(MLDSA65_ECDSA_P256, 20)
ML_DSA_65_ED25519 = _composite_type(MLDSA65_ED25519, 21)
ML_DSA_65_SM2 = _composite_type(MLDSA65_SM2, 22)
