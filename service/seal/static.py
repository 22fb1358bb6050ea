"""The static seal: the master key itself in ``CRYPTD_MASTER_KEY`` or the file named by
``CRYPTD_MASTER_KEY_FILE``. Whoever reads that variable or file holds every key, so
production accepts it only with a warning at every start (service.api.application)."""

from __future__ import annotations

from service.config import SealSettings
from service.seal.base import SealError, SealStatus

WARNING = (
    "CRYPTD_SEAL=static: the master key is in the environment or a file, readable by whoever "
    "reads them; use CRYPTD_SEAL=pkcs11 in production (docs/DEPLOY.md, Seals)"
)


class StaticSeal:
    kind = "static"

    def __init__(self, settings: SealSettings) -> None:
        self._settings = settings

    def unseal(self) -> bytes:
        if self._settings.master_key is None and self._settings.master_key_file is None:
            raise SealError(
                "CRYPTD_SEAL=static needs CRYPTD_MASTER_KEY or CRYPTD_MASTER_KEY_FILE "
                "(cryptd master-key generate makes one)"
            )
        try:
            return self._settings.load_master_key()
        except OSError as exc:
            raise SealError(f"CRYPTD_MASTER_KEY_FILE cannot be read ({exc.strerror})") from None
        except ValueError as exc:
            raise SealError(str(exc)) from None

    def status(self) -> SealStatus:
        return SealStatus(self.kind, sealed=False, threshold=1, progress=0, available=True)

    def close(self) -> None:
        pass
