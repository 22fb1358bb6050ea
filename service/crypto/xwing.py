"""X-Wing (draft-connolly-cfrg-xwing-kem, HPKE KEM 0x647a) outside HPKE: the seed expansion
and raw encapsulation that pyca/cryptography keeps inside ``hpke.KEM.MLKEM768_X25519``.

Every primitive is pyca's (ML-KEM-768, X25519, SHAKE256, SHA3-256); this module only joins
them as the draft says, no arithmetic of its own:

    expanded        = SHAKE256(seed, 96)
    ML-KEM-768 seed = expanded[0:64]  (d || z),  X25519 private key = expanded[64:96]
    ciphertext      = ct_M (1088) || ct_X (32, the ephemeral X25519 public key)
    shared secret   = SHA3-256(ss_M || ss_X || ct_X || pk_X || "\\.//^\\")

tests/test_crypto_pq.py checks it against the draft-ietf-hpke-pq vectors (seed to public key,
``enc`` to shared secret) and tests/test_pq_api.py against @hpke/hybridkem-x-wing. An
ephemeral key of small order gives X25519 an all-zero output, which pyca refuses: such a
ciphertext is refused (400) rather than decapsulated; it depends on public bytes only.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519

from service.crypto.base import InvalidOptions

SEED_SIZE = 32
CIPHERTEXT_SIZE = 1088 + 32
_LABEL = b"\\.//^\\"  # the draft's XWingLabel, 6 bytes: 5c 2e 2f 2f 5e 5c


def expand(seed: bytes) -> tuple[mlkem.MLKEM768PrivateKey, x25519.X25519PrivateKey]:
    """The ML-KEM-768 and X25519 private keys of an X-Wing seed."""
    shake = hashes.Hash(hashes.SHAKE256(96))
    shake.update(seed)
    expanded = shake.finalize()
    return (
        mlkem.MLKEM768PrivateKey.from_seed_bytes(expanded[:64]),
        x25519.X25519PrivateKey.from_private_bytes(expanded[64:]),
    )


def _combine(ss_m: bytes, ss_x: bytes, ct_x: bytes, pk_x: bytes) -> bytes:
    digest = hashes.Hash(hashes.SHA3_256())
    for part in (ss_m, ss_x, ct_x, pk_x, _LABEL):
        digest.update(part)
    return digest.finalize()


class XWing:
    """One X-Wing key pair's raw encapsulation (pyca's argument order: secret first)."""

    __slots__ = ("_mlkem", "_mlkem_public", "_x25519", "_x25519_public")

    def __init__(self, mlkem_key: mlkem.MLKEM768PrivateKey, x25519_key: x25519.X25519PrivateKey):
        self._mlkem = mlkem_key
        self._mlkem_public = mlkem_key.public_key()
        self._x25519 = x25519_key
        self._x25519_public = x25519_key.public_key().public_bytes_raw()

    def encapsulate(self) -> tuple[bytes, bytes]:
        """(shared secret, ciphertext) for this key's public key."""
        ephemeral = x25519.X25519PrivateKey.generate()
        ct_x = ephemeral.public_key().public_bytes_raw()
        ss_x = ephemeral.exchange(x25519.X25519PublicKey.from_public_bytes(self._x25519_public))
        ss_m, ct_m = self._mlkem_public.encapsulate()
        return _combine(ss_m, ss_x, ct_x, self._x25519_public), ct_m + ct_x

    def decapsulate(self, ciphertext: bytes) -> bytes:
        if len(ciphertext) != CIPHERTEXT_SIZE:
            raise InvalidOptions(f"x25519-ml-kem-768 ciphertext must be {CIPHERTEXT_SIZE} bytes")
        ct_m, ct_x = ciphertext[:1088], ciphertext[1088:]
        ss_m = self._mlkem.decapsulate(ct_m)
        try:
            ss_x = self._x25519.exchange(x25519.X25519PublicKey.from_public_bytes(ct_x))
        except ValueError:
            raise InvalidOptions(
                "x25519-ml-kem-768 ciphertext: X25519 part of small order"
            ) from None
        return _combine(ss_m, ss_x, ct_x, self._x25519_public)
