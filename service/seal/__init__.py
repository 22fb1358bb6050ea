"""Seals: what keeps the master key at rest and gives it to a starting process.

One module per seal behind :class:`service.seal.base.Seal`, chosen with ``CRYPTD_SEAL``. Once
unsealed, the master key lives in the process's memory (service.keys.masterkey), so crypto runs
at the same speed whatever the seal.
"""

from __future__ import annotations

from service.config import SealSettings
from service.keys.masterkey import MasterKey
from service.seal.base import Seal, SealError, SealStatus


def open_seal(settings: SealSettings) -> Seal:
    """The seal ``settings`` name; nothing is read or opened until ``unseal``."""
    if settings.seal == "pkcs11":
        from service.seal.pkcs11 import Pkcs11Seal  # the binding is an optional extra

        return Pkcs11Seal.from_settings(settings)
    from service.seal.static import StaticSeal

    return StaticSeal(settings)


def unseal_once(settings: SealSettings | None = None) -> bytes:
    """The master key for a one-shot use (the CLI, the check before the workers start): the
    seal opened, unsealed and closed again."""
    seal = open_seal(settings or SealSettings())
    try:
        return seal.unseal()
    finally:
        seal.close()


def unseal_master_key(settings: SealSettings | None = None) -> MasterKey:
    return MasterKey(unseal_once(settings))


__all__ = ["Seal", "SealError", "SealStatus", "open_seal", "unseal_master_key", "unseal_once"]
