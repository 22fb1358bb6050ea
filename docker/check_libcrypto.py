"""Build-time check that the system libcrypto does what cryptd binds it for.

cryptd reaches SM2 through the system OpenSSL 3 (cffi, ABI mode); some distributions build
OpenSSL without SM2. The image build runs this, so a base image without SM2 fails the build
instead of the first SM2 request. It uses the service's own binding, so the check cannot drift
from what the service needs, and runs one SM2 sign/verify and encrypt/decrypt round trip.
"""

from __future__ import annotations

import sys

from service.crypto import _libcrypto
from service.crypto.base import SignOptions
from service.crypto.sm2 import SM2


def main() -> int:
    if not _libcrypto.available():
        print("libcrypto: OpenSSL 3 with SM2 not found", file=sys.stderr)
        return 1
    key = SM2.load(SM2.generate())
    options = SignOptions()
    signature = key.sign(b"check", prehashed=False, options=options)
    sealed = key.encrypt(b"check", b"")
    if not key.verify(signature, b"check", prehashed=False, options=options) or (
        key.decrypt(sealed, b"") != b"check"
    ):
        print("libcrypto: SM2 round trip failed", file=sys.stderr)
        return 1
    print(f"libcrypto OK: {_libcrypto.version()}, SM2 sign/verify and encrypt/decrypt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
