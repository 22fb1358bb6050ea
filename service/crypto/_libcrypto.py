"""A thin cffi binding (ABI mode) to the system's OpenSSL 3 libcrypto, for SM2.

pyca/cryptography refuses the SM2 curve (pyca/cryptography issue 6857), so SM2 signatures and
encryption go to the platform's libcrypto through its OpenSSL 3 EVP and OSSL_DECODER functions.
Only opaque pointers are declared: no header, no compiler and no struct layout are needed, and
the library is found at run time (``libcrypto.so.3``, then ``ctypes.util.find_library``).

Rules every function here follows:
- every return code is checked; an unexpected failure raises :class:`LibcryptoError` whose
  message names the failing step and nothing else (no key, no data);
- every object is freed: per-call contexts in ``finally``, keys by ``ffi.gc``;
- OpenSSL's per-thread error queue is cleared after every failure, expected ones (a signature
  that does not verify, a ciphertext whose C3 does not match) included, so no error leaks into a
  later call on the same thread;
- cffi releases the GIL around each foreign call, so a thread pool runs SM2 on several cores.
"""

from __future__ import annotations

import ctypes.util
import functools
from typing import Any, NoReturn

from cffi import FFI

_CDEF = """
typedef struct evp_pkey_st EVP_PKEY;
typedef struct evp_pkey_ctx_st EVP_PKEY_CTX;
typedef struct ossl_decoder_ctx_st OSSL_DECODER_CTX;
typedef struct bignum_st BIGNUM;

unsigned long OpenSSL_version_num(void);
const char *OpenSSL_version(int type);
void ERR_clear_error(void);
unsigned long ERR_peek_error(void);
void OPENSSL_cleanse(void *ptr, size_t len);

EVP_PKEY_CTX *EVP_PKEY_CTX_new_from_name(void *libctx, const char *name, const char *propquery);
EVP_PKEY_CTX *EVP_PKEY_CTX_new_from_pkey(void *libctx, EVP_PKEY *pkey, const char *propquery);
void EVP_PKEY_CTX_free(EVP_PKEY_CTX *ctx);

int EVP_PKEY_keygen_init(EVP_PKEY_CTX *ctx);
int EVP_PKEY_generate(EVP_PKEY_CTX *ctx, EVP_PKEY **ppkey);
void EVP_PKEY_free(EVP_PKEY *pkey);
int EVP_PKEY_is_a(const EVP_PKEY *pkey, const char *name);
int EVP_PKEY_check(EVP_PKEY_CTX *ctx);
int EVP_PKEY_get_bn_param(const EVP_PKEY *pkey, const char *key_name, BIGNUM **bn);
int EVP_PKEY_get_octet_string_param(const EVP_PKEY *pkey, const char *key_name,
                                    unsigned char *buf, size_t max_buf_sz, size_t *out_sz);
int EVP_PKEY_get_utf8_string_param(const EVP_PKEY *pkey, const char *key_name,
                                   char *str, size_t max_buf_sz, size_t *out_sz);
int i2d_PUBKEY(const EVP_PKEY *a, unsigned char **pp);
int BN_bn2binpad(const BIGNUM *a, unsigned char *to, int tolen);
void BN_clear_free(BIGNUM *a);

OSSL_DECODER_CTX *OSSL_DECODER_CTX_new_for_pkey(EVP_PKEY **pkey, const char *input_type,
                                                const char *input_struct, const char *keytype,
                                                int selection, void *libctx,
                                                const char *propquery);
int OSSL_DECODER_from_data(OSSL_DECODER_CTX *ctx, const unsigned char **pdata,
                           size_t *pdata_len);
void OSSL_DECODER_CTX_free(OSSL_DECODER_CTX *ctx);

int EVP_PKEY_sign_init(EVP_PKEY_CTX *ctx);
int EVP_PKEY_sign(EVP_PKEY_CTX *ctx, unsigned char *sig, size_t *siglen,
                  const unsigned char *tbs, size_t tbslen);
int EVP_PKEY_verify_init(EVP_PKEY_CTX *ctx);
int EVP_PKEY_verify(EVP_PKEY_CTX *ctx, const unsigned char *sig, size_t siglen,
                    const unsigned char *tbs, size_t tbslen);
int EVP_PKEY_encrypt_init(EVP_PKEY_CTX *ctx);
int EVP_PKEY_encrypt(EVP_PKEY_CTX *ctx, unsigned char *out, size_t *outlen,
                     const unsigned char *in, size_t inlen);
int EVP_PKEY_decrypt_init(EVP_PKEY_CTX *ctx);
int EVP_PKEY_decrypt(EVP_PKEY_CTX *ctx, unsigned char *out, size_t *outlen,
                     const unsigned char *in, size_t inlen);
"""

ffi = FFI()
ffi.cdef(_CDEF)

_SONAMES = ("libcrypto.so.3", "libcrypto.3.dylib")
_MIN_VERSION = 0x30000000
_OPENSSL_VERSION = 0  # OpenSSL_version(OPENSSL_VERSION)
_KEYPAIR = 0x87  # EVP_PKEY_KEYPAIR: private + public key + domain parameters
_PUBLIC_KEY = 0x86  # EVP_PKEY_PUBLIC_KEY: public key + domain parameters
_MAX_SIGNATURE = 72  # DER SEQUENCE of two 33-byte INTEGERs
_POINT = 65  # 04 || x || y
_SCALAR = 32


class LibcryptoUnavailable(RuntimeError):
    """No OpenSSL 3 libcrypto with SM2 on this machine."""


class LibcryptoError(RuntimeError):
    """libcrypto failed where it should not (allocation, a broken build). Never says why in
    terms of data: the message names the step only."""


@functools.cache
def lib() -> Any:
    """The loaded libcrypto; loaded on first use so importing the service never needs it."""
    names = list(_SONAMES)
    found = ctypes.util.find_library("crypto")
    if found:
        names.append(found)
    for name in names:
        try:
            handle: Any = ffi.dlopen(name)
            if handle.OpenSSL_version_num() >= _MIN_VERSION and _has_sm2(handle):
                return handle
        except (OSError, AttributeError):  # not found, or an old library missing a symbol
            continue
    raise LibcryptoUnavailable(
        "SM2 needs the system OpenSSL 3 libcrypto (libcrypto.so.3) with SM2 enabled"
    )


def _has_sm2(handle: Any) -> bool:
    ctx = handle.EVP_PKEY_CTX_new_from_name(ffi.NULL, b"SM2", ffi.NULL)
    if ctx == ffi.NULL:
        handle.ERR_clear_error()
        return False
    handle.EVP_PKEY_CTX_free(ctx)
    return True


def available() -> bool:
    try:
        lib()
    except LibcryptoUnavailable:
        return False
    return True


def version() -> str:
    return _text(lib().OpenSSL_version(_OPENSSL_VERSION))


def _fail(step: str) -> NoReturn:
    lib().ERR_clear_error()
    raise LibcryptoError(f"libcrypto: {step} failed")


def _bytes(cdata: Any, size: int) -> bytes:
    return bytes(ffi.buffer(cdata, size))


def _text(cdata: Any) -> str:
    value = ffi.string(cdata)
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


class Sm2PublicKey:
    """An SM2 public key inside libcrypto (an ``EVP_PKEY``; freed with this object): it
    verifies. libcrypto allows concurrent use of one EVP_PKEY from several threads; each
    operation makes its own short-lived context."""

    __slots__ = ("_pkey",)

    def __init__(self, pkey: Any) -> None:
        self._pkey = ffi.gc(pkey, lib().EVP_PKEY_free)

    @classmethod
    def decode_public(cls, der: bytes) -> Sm2PublicKey | None:
        """Parse a DER SubjectPublicKeyInfo as an SM2 public key; None if it is not one."""
        return Sm2PublicKey._decode(der, "SubjectPublicKeyInfo", _PUBLIC_KEY)

    @classmethod
    def _decode(cls, der: bytes | bytearray, structure: str, selection: int) -> Sm2PublicKey | None:
        crypto = lib()
        out = ffi.new("EVP_PKEY **")
        dctx = crypto.OSSL_DECODER_CTX_new_for_pkey(
            out, b"DER", structure.encode("ascii"), b"SM2", selection, ffi.NULL, ffi.NULL
        )
        if dctx == ffi.NULL:
            _fail("OSSL_DECODER_CTX_new_for_pkey")
        try:
            data = ffi.new("const unsigned char **", ffi.from_buffer(der))
            remaining = ffi.new("size_t *", len(der))
            decoded = crypto.OSSL_DECODER_from_data(dctx, data, remaining) == 1
        finally:
            crypto.OSSL_DECODER_CTX_free(dctx)
        key = cls(out[0]) if out[0] != ffi.NULL else None  # owned (and freed) from here on
        if (
            not decoded
            or key is None
            or remaining[0] != 0  # trailing bytes
            or crypto.EVP_PKEY_is_a(key._pkey, b"SM2") != 1
            or key._group() != "SM2"
        ):
            crypto.ERR_clear_error()
            return None
        return key

    def _group(self) -> str:
        name = ffi.new("char[]", 64)
        size = ffi.new("size_t *")
        if lib().EVP_PKEY_get_utf8_string_param(self._pkey, b"group", name, 64, size) != 1:
            lib().ERR_clear_error()
            return ""
        return _text(name)

    def public_point(self) -> bytes:
        """The uncompressed public point 04 || x || y."""
        out = ffi.new("unsigned char[]", _POINT)
        size = ffi.new("size_t *")
        if lib().EVP_PKEY_get_octet_string_param(self._pkey, b"pub", out, _POINT, size) != 1:
            _fail("EVP_PKEY_get_octet_string_param(pub)")
        if size[0] != _POINT or out[0] != 4:
            raise LibcryptoError("libcrypto: public point is not uncompressed")
        return _bytes(out, _POINT)

    def verify_digest(self, signature: bytes, digest: bytes) -> bool:
        crypto = lib()
        ctx = self._context()
        try:
            if crypto.EVP_PKEY_verify_init(ctx) != 1:
                _fail("EVP_PKEY_verify_init")
            valid = bool(
                crypto.EVP_PKEY_verify(
                    ctx,
                    ffi.from_buffer(signature),
                    len(signature),
                    ffi.from_buffer(digest),
                    len(digest),
                )
                == 1
            )
        finally:
            crypto.EVP_PKEY_CTX_free(ctx)
        if not valid:
            crypto.ERR_clear_error()
        return valid

    def _context(self) -> Any:
        ctx = lib().EVP_PKEY_CTX_new_from_pkey(ffi.NULL, self._pkey, ffi.NULL)
        if ctx == ffi.NULL:
            _fail("EVP_PKEY_CTX_new_from_pkey")
        return ctx


class Sm2PrivateKey(Sm2PublicKey):
    """An SM2 key pair inside libcrypto: it also signs and decrypts."""

    __slots__ = ()

    def __getstate__(self) -> NoReturn:
        raise TypeError("SM2 private keys cannot be pickled")

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def generate(cls) -> Sm2PrivateKey:
        crypto = lib()
        ctx = crypto.EVP_PKEY_CTX_new_from_name(ffi.NULL, b"SM2", ffi.NULL)
        if ctx == ffi.NULL:
            _fail("EVP_PKEY_CTX_new_from_name(SM2)")
        try:
            out = ffi.new("EVP_PKEY **")
            if crypto.EVP_PKEY_keygen_init(ctx) != 1 or crypto.EVP_PKEY_generate(ctx, out) != 1:
                _fail("SM2 key generation")
        finally:
            crypto.EVP_PKEY_CTX_free(ctx)
        return cls(out[0])

    @classmethod
    def decode(cls, der: bytes | bytearray, structure: str) -> Sm2PrivateKey | None:
        """Parse a DER private key (``structure``: "PrivateKeyInfo" for PKCS#8,
        "type-specific" for RFC 5915 ECPrivateKey) as an SM2 key; None if it is not one.

        A missing public key is derived from the scalar by libcrypto."""
        key = cls._decode(der, structure, _KEYPAIR)
        return key if isinstance(key, Sm2PrivateKey) else None

    # --- key data ---------------------------------------------------------------------------

    def check(self) -> bool:
        """Full validation: scalar range, public point on the curve, and that they match."""
        crypto = lib()
        ctx = crypto.EVP_PKEY_CTX_new_from_pkey(ffi.NULL, self._pkey, ffi.NULL)
        if ctx == ffi.NULL:
            _fail("EVP_PKEY_CTX_new_from_pkey")
        try:
            valid = bool(crypto.EVP_PKEY_check(ctx) == 1)
        finally:
            crypto.EVP_PKEY_CTX_free(ctx)
        if not valid:
            crypto.ERR_clear_error()
        return valid

    def scalar(self) -> bytes:
        crypto = lib()
        bn = ffi.new("BIGNUM **")
        if crypto.EVP_PKEY_get_bn_param(self._pkey, b"priv", bn) != 1:
            _fail("EVP_PKEY_get_bn_param(priv)")
        out = ffi.new("unsigned char[]", _SCALAR)
        try:
            if crypto.BN_bn2binpad(bn[0], out, _SCALAR) != _SCALAR:
                _fail("BN_bn2binpad")
            return _bytes(out, _SCALAR)
        finally:
            crypto.BN_clear_free(bn[0])
            crypto.OPENSSL_cleanse(out, _SCALAR)

    def public_key_der(self) -> bytes:
        """SubjectPublicKeyInfo DER (id-ecPublicKey with the SM2 curve OID)."""
        crypto = lib()
        size = crypto.i2d_PUBKEY(self._pkey, ffi.NULL)
        if size <= 0:
            _fail("i2d_PUBKEY")
        out = ffi.new("unsigned char[]", size)
        cursor = ffi.new("unsigned char **", out)
        if crypto.i2d_PUBKEY(self._pkey, cursor) != size:
            _fail("i2d_PUBKEY")
        return _bytes(out, size)

    # --- signatures (DER SEQUENCE { r, s }) over e = SM3(Z || M) ---------------------------

    def sign_digest(self, digest: bytes) -> bytes:
        """SM2 signature over a precomputed e = SM3(Z || M) (32 bytes)."""
        crypto = lib()
        ctx = self._context()
        try:
            if crypto.EVP_PKEY_sign_init(ctx) != 1:
                _fail("EVP_PKEY_sign_init")
            signature = ffi.new("unsigned char[]", _MAX_SIGNATURE)
            size = ffi.new("size_t *", _MAX_SIGNATURE)
            if (
                crypto.EVP_PKEY_sign(ctx, signature, size, ffi.from_buffer(digest), len(digest))
                != 1
            ):
                _fail("EVP_PKEY_sign")
            return _bytes(signature, size[0])
        finally:
            crypto.EVP_PKEY_CTX_free(ctx)

    # --- encryption (GM/T 0009 DER ciphertext) ---------------------------------------------

    def encrypt(self, plaintext: bytes) -> bytes:
        """SM2 public-key encryption with SM3; returns GM/T 0009 DER."""
        crypto = lib()
        ctx = self._context()
        try:
            if crypto.EVP_PKEY_encrypt_init(ctx) != 1:
                _fail("EVP_PKEY_encrypt_init")
            data = ffi.from_buffer(plaintext)
            size = ffi.new("size_t *")
            if crypto.EVP_PKEY_encrypt(ctx, ffi.NULL, size, data, len(plaintext)) != 1:
                _fail("EVP_PKEY_encrypt")
            out = ffi.new("unsigned char[]", size[0])
            if crypto.EVP_PKEY_encrypt(ctx, out, size, data, len(plaintext)) != 1:
                _fail("EVP_PKEY_encrypt")
            return _bytes(out, size[0])
        finally:
            crypto.EVP_PKEY_CTX_free(ctx)

    def decrypt(self, der: bytes) -> bytes | None:
        """Decrypt GM/T 0009 DER; None for any failure (C1 off the curve, C3 mismatch -
        libcrypto compares C3 in constant time - or a malformed input)."""
        crypto = lib()
        ctx = self._context()
        try:
            if crypto.EVP_PKEY_decrypt_init(ctx) != 1:
                _fail("EVP_PKEY_decrypt_init")
            data = ffi.from_buffer(der)
            size = ffi.new("size_t *")
            if crypto.EVP_PKEY_decrypt(ctx, ffi.NULL, size, data, len(der)) != 1:
                crypto.ERR_clear_error()
                return None
            capacity = size[0]
            out = ffi.new("unsigned char[]", capacity)
            try:
                if crypto.EVP_PKEY_decrypt(ctx, out, size, data, len(der)) != 1:
                    crypto.ERR_clear_error()
                    return None
                return _bytes(out, size[0])
            finally:
                crypto.OPENSSL_cleanse(out, capacity)
        finally:
            crypto.EVP_PKEY_CTX_free(ctx)
