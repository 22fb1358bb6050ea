"""The key type registry: every type cryptd knows, by name and by token id."""

from __future__ import annotations

from types import MappingProxyType

from service.crypto.base import KeyType
from service.crypto.composite import ML_DSA_65_ECDSA_P256, ML_DSA_65_ED25519, ML_DSA_65_SM2
from service.crypto.ecdsa import ECDSA_P256, ECDSA_P384, ECDSA_P521
from service.crypto.ed25519 import ED25519
from service.crypto.hmac import HMAC_SHA256, HMAC_SHA512, HMAC_SM3
from service.crypto.mldsa import ML_DSA_44, ML_DSA_65, ML_DSA_87
from service.crypto.mlkem import ML_KEM_768, ML_KEM_1024, X25519_ML_KEM_768
from service.crypto.rsa import RSA_2048, RSA_3072, RSA_4096
from service.crypto.sm2 import SM2
from service.crypto.symmetric import AES256_GCM, SM4_GCM

_ALL = (
    AES256_GCM,
    SM4_GCM,
    RSA_2048,
    RSA_3072,
    RSA_4096,
    ECDSA_P256,
    ED25519,
    SM2,
    HMAC_SHA256,
    HMAC_SHA512,
    HMAC_SM3,
    ECDSA_P384,
    ECDSA_P521,
    ML_DSA_44,
    ML_DSA_65,
    ML_DSA_87,
    ML_KEM_768,
    ML_KEM_1024,
    X25519_ML_KEM_768,
    ML_DSA_65_ECDSA_P256,
    ML_DSA_65_ED25519,
    ML_DSA_65_SM2,
)

KEY_TYPES: MappingProxyType[str, KeyType] = MappingProxyType({t.name: t for t in _ALL})
KEY_TYPES_BY_ID: MappingProxyType[int, KeyType] = MappingProxyType({t.type_id: t for t in _ALL})


def key_type(name: str) -> KeyType:
    """Return the type called ``name``; KeyError if there is none."""
    return KEY_TYPES[name]
