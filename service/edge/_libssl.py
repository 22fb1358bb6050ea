"""The libssl setting Python's ``ssl`` module does not expose: the TLS 1.3 cipher-suite list of
a context (``SSL_CTX_set_ciphersuites``).

The functions are looked up in the library the ``ssl`` module itself is linked with (``_ssl``'s
own shared object and its dependencies), so they act on the same OpenSSL. An ``SSLContext``'s
``SSL_CTX *`` is the first field after the object's header in CPython's ``_ssl`` module (the
same since Python 3.0, not a public API): before anything is written through it, the pointer is
checked by reading the context's options through OpenSSL and comparing them with
``SSLContext.options``. When the library, a function or that check fails, :class:`LibsslError`
says so and nothing was changed.
"""

from __future__ import annotations

import ctypes
import functools
import ssl
from typing import Any

from cffi import FFI

_CDEF = """
int SSL_CTX_set_ciphersuites(void *ctx, const char *str);
uint64_t SSL_CTX_get_options(const void *ctx);
void ERR_clear_error(void);
"""
ffi = FFI()
ffi.cdef(_CDEF)


class LibsslError(RuntimeError):
    """libssl, one of its functions, or a context's pointer was not found as expected."""


@functools.cache
def _lib() -> Any:
    import _ssl

    path = getattr(_ssl, "__file__", None)  # None: _ssl built into the interpreter
    try:
        return ffi.dlopen(path)
    except OSError:
        raise LibsslError("the ssl module's libssl could not be opened") from None


def _ctx(context: ssl.SSLContext) -> Any:
    """The context's ``SSL_CTX *``, checked against its options."""
    try:
        lib = _lib()
        get_options = lib.SSL_CTX_get_options
    except AttributeError:
        raise LibsslError("libssl has no SSL_CTX_get_options") from None
    address = ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value
    if not address:
        raise LibsslError("no SSL_CTX in the SSLContext")
    pointer = ffi.cast("void *", address)
    if get_options(pointer) != context.options:
        raise LibsslError("the SSLContext's layout is not the one expected")
    return pointer


def set_tls13_suites(context: ssl.SSLContext, suites: str) -> None:
    """Offer these TLS 1.3 suites (colon-separated OpenSSL names), in this order of preference
    (the server's order when ``OP_CIPHER_SERVER_PREFERENCE`` is set)."""
    pointer = _ctx(context)
    lib = _lib()
    if lib.SSL_CTX_set_ciphersuites(pointer, suites.encode("ascii")) != 1:
        lib.ERR_clear_error()
        raise LibsslError(f"OpenSSL refused the TLS 1.3 suites {suites}")
