"""Build-time check that the system libcrypto can do what cryptd binds it for.

cryptd reaches SM2 through the system OpenSSL 3 (cffi, ABI mode); some distributions build
OpenSSL without SM2. The image build runs this so a base image without SM2 fails the build
instead of the first SM2 request. Exit status 0 when OpenSSL >= 3 with the SM2 curve and SM3.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

NID_SM2 = 1172  # obj_mac.h
OPENSSL_3 = 0x30000000


def load() -> ctypes.CDLL:
    for name in ("libcrypto.so.3", ctypes.util.find_library("crypto")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise OSError("libcrypto (OpenSSL 3) not found")


def problems(lib: ctypes.CDLL) -> list[str]:
    """Return what is missing; an empty list means libcrypto is fit for cryptd."""
    found: list[str] = []
    lib.OpenSSL_version_num.restype = ctypes.c_ulong
    if lib.OpenSSL_version_num() < OPENSSL_3:
        found.append("OpenSSL older than 3.0")
    lib.EC_GROUP_new_by_curve_name.restype = ctypes.c_void_p
    lib.EC_GROUP_new_by_curve_name.argtypes = [ctypes.c_int]
    lib.EC_GROUP_free.argtypes = [ctypes.c_void_p]
    group = lib.EC_GROUP_new_by_curve_name(NID_SM2)
    if group:
        lib.EC_GROUP_free(group)
    else:
        found.append("no SM2 curve")
    lib.EVP_get_digestbyname.restype = ctypes.c_void_p
    lib.EVP_get_digestbyname.argtypes = [ctypes.c_char_p]
    if not lib.EVP_get_digestbyname(b"SM3"):
        found.append("no SM3 digest")
    return found


def main() -> int:
    try:
        missing = problems(load())
    except (OSError, AttributeError) as exc:
        missing = [str(exc)]
    if missing:
        print("libcrypto unfit for cryptd: " + ", ".join(missing), file=sys.stderr)
        return 1
    print("libcrypto: OpenSSL 3 with SM2 and SM3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
