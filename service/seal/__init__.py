"""Seals: what keeps the master key at rest and gives it to a starting process.

One module per seal behind :class:`service.seal.base.Seal`, chosen with ``CRYPTD_SEAL``. Once
unsealed, the master key lives in the process's memory (service.keys.masterkey), so crypto runs
at the same speed whatever the seal.
"""

from __future__ import annotations

import getpass
import sys
from collections.abc import Callable

from service.config import SealSettings
from service.keys.masterkey import MasterKey
from service.seal.base import Seal, SealError, SealStatus


def open_seal(settings: SealSettings) -> Seal:
    """The seal ``settings`` name; nothing is read or opened until ``unseal``."""
    if settings.seal == "shamir":
        from service.seal.shamir import ShamirSeal

        return ShamirSeal(settings.sealed_master_key_path())
    if settings.seal == "pkcs11":
        from service.seal.pkcs11 import Pkcs11Seal  # the binding is an optional extra

        return Pkcs11Seal.from_settings(settings)
    if settings.seal == "transit":
        from service.seal.transit import TransitSeal

        return TransitSeal.from_settings(settings)
    from service.seal.static import StaticSeal

    return StaticSeal(settings)


def unseal_once(settings: SealSettings | None = None) -> bytes:
    """The master key for a one-shot use (the CLI, the check before the workers start): the
    seal opened, unsealed and closed again."""
    seal = open_seal(settings or SealSettings())
    try:
        submit = getattr(seal, "submit", None)
        if submit is not None:
            _submit_shares(seal, submit)
        return seal.unseal()
    finally:
        seal.close()


def _submit_shares(seal: Seal, submit: Callable[[str], SealStatus]) -> None:
    """A sealed seal (shamir) in a one-shot command: the operators enter their shares on
    stdin, one per line (hidden at a terminal), until it opens; a refused share is said so
    and the next one asked for."""
    status = seal.status()
    print(f"cryptd: sealed: enter {status.threshold} unseal shares, one per line", file=sys.stderr)
    while status.sealed:
        if sys.stdin.isatty():
            line = getpass.getpass(f"share {status.progress + 1}/{status.threshold}: ")
        else:
            line = sys.stdin.readline()
            if not line:
                raise SealError(f"stdin ended after {status.progress} of {status.threshold} shares")
        try:
            status = submit(line)
        except SealError as exc:
            print(f"cryptd: share refused: {exc}", file=sys.stderr)
            status = seal.status()


def unseal_master_key(settings: SealSettings | None = None) -> MasterKey:
    return MasterKey(unseal_once(settings))


__all__ = ["Seal", "SealError", "SealStatus", "open_seal", "unseal_master_key", "unseal_once"]
