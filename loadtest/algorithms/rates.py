"""The in-process algorithm benchmark behind ``cryptd bench``: SM2 (through libcrypto) against
RSA-2048, ECDSA-P256 and Ed25519 (pyca/cryptography) and the pure-Python ``gmssl`` package, in
one run on this machine, so the ratios mean something even on a busy host.

Measurements (ops/s, one thread unless stated):

- the main table: keygen, encrypt, decrypt, sign, verify. Encrypt/decrypt is the public-key
  primitive on a 32-byte data key (SM2 C1C3C2; RSA-OAEP-SHA256); signatures are over a 32-byte
  message (SM2 with SM3 and Z, default signer ID; RSA-PSS-SHA256; ECDSA-P256-SHA256; Ed25519);
- the payload table: encrypt/decrypt of 16 B .. 8 KiB, as the service does it (hybrid: SM2 wraps
  an SM4-GCM key; RSA-OAEP wraps an AES-256-GCM key) and as plain SM2 of the whole payload (the
  origin article's and gmssl's way);
- SM2 on several threads, which shows the libcrypto calls release the GIL;
- the post-quantum key types (ML-DSA, composite ML-DSA-65, ML-KEM, X-Wing) against RSA-2048,
  RSA-3072, ECDSA-P256, Ed25519 and SM2 through cryptd's key handles, with the exact sizes of
  signatures, tokens, KEM ciphertexts and public keys (:mod:`.pq`).

``gmssl`` is a reference only (non-cryptographic nonces, C3 never checked): it is measured when
installed and never used by the service.
"""

from __future__ import annotations

import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from loadtest.algorithms import pq
from service.crypto import _libcrypto, hybrid, sm2
from service.crypto._sm2_codec import GX, GY, N
from service.crypto.aead import AesGcm
from service.crypto.base import SignOptions
from service.crypto.sm2 import Sm2Key

Op = Callable[[], object]

OPERATIONS = ("keygen", "encrypt", "decrypt", "sign", "verify")
REFERENCE_OPERATIONS = ("sign", "verify", "encrypt", "decrypt")
BACKENDS = ("sm2", "rsa-2048", "ecdsa-p256", "ed25519", "gmssl")
PAYLOAD_BACKENDS = ("sm2-hybrid", "rsa-2048-hybrid", "sm2-raw", "gmssl-raw")
DEFAULT_SIZES = (16, 128, 1024, 8192)
KEY_PAYLOAD = 32  # a data key: what the service's public-key encryption carries
MESSAGE = b"cryptd bench message, 32 bytes."
THREADS = "sm2-threads"  # the backend name of the one-thread / several-threads comparison
RSA_PRIVATE = "rsa-2048-private"  # RSA-2048 PSS signing, measured beside each reference operation

_OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
_SHA256 = hashes.SHA256()
_ECDSA = ec.ECDSA(hashes.SHA256())
_SM2_OPTIONS = SignOptions()


@dataclass(frozen=True)
class Result:
    backend: str
    operation: str
    ops_per_s: float
    iterations: int
    payload: int | None = None
    threads: int = 1


@dataclass
class Report:
    seconds: float
    meta: dict[str, str | int]
    results: list[Result] = field(default_factory=list)
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)  # key type -> bytes (pq)

    def rate(
        self, backend: str, operation: str, payload: int | None = None, threads: int = 1
    ) -> float | None:
        for r in self.results:
            if (r.backend, r.operation, r.payload, r.threads) == (
                backend,
                operation,
                payload,
                threads,
            ):
                return r.ops_per_s
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "meta": self.meta,
            "results": [asdict(r) for r in self.results],
            "sizes": self.sizes,
            "ratios": ratios(self),
            "references": references(self),
        }


def _timed(op: Op, seconds: float, threads: int) -> tuple[int, float]:
    """Run ``op`` back to back for ``seconds`` on ``threads`` threads: (calls, elapsed)."""
    counts = [0] * threads

    def loop(slot: int, deadline: float) -> None:
        n = 0
        while True:
            op()
            n += 1
            if time.perf_counter() >= deadline:
                break
        counts[slot] = n

    start = time.perf_counter()
    if threads == 1:
        loop(0, start + seconds)
    else:
        workers = [threading.Thread(target=loop, args=(i, start + seconds)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    return sum(counts), time.perf_counter() - start


def measure(op: Op, seconds: float, threads: int = 1) -> tuple[float, int]:
    """(ops/s, iterations) of ``op`` over ``seconds``, after one warm-up call."""
    op()  # first-call costs (provider fetches, imports) are not throughput
    calls, elapsed = _timed(op, seconds, threads)
    return calls / elapsed, calls


def compare(
    candidates: dict[str, tuple[Op, int]], seconds: float, rounds: int
) -> dict[str, tuple[float, int]]:
    """Measure candidates (name -> (op, threads)) in alternating slices, ``rounds`` each, so
    load that drifts on a shared machine hits them alike. name -> (ops/s, iterations)."""
    for op, _ in candidates.values():
        op()  # warm up
    totals = dict.fromkeys(candidates, (0, 0.0))
    for _ in range(rounds):
        for name, (op, threads) in candidates.items():
            calls, elapsed = _timed(op, seconds / rounds, threads)
            done, spent = totals[name]
            totals[name] = (done + calls, spent + elapsed)
    return {name: (calls / spent, calls) for name, (calls, spent) in totals.items()}


# --- the candidates ---------------------------------------------------------------------------


def _sm2_ops(key: Sm2Key, payload: bytes) -> dict[str, Op]:
    ciphertext = key.encrypt_raw(payload)
    signature = key.sign(MESSAGE, prehashed=False, options=_SM2_OPTIONS)
    return {
        "keygen": sm2.generate,
        "encrypt": lambda: key.encrypt_raw(payload),
        "decrypt": lambda: key.decrypt_external(ciphertext, "sm2"),
        "sign": lambda: key.sign(MESSAGE, prehashed=False, options=_SM2_OPTIONS),
        "verify": lambda: key.verify(signature, MESSAGE, prehashed=False, options=_SM2_OPTIONS),
    }


def _rsa_ops(key: rsa.RSAPrivateKey, payload: bytes) -> dict[str, Op]:
    public = key.public_key()
    ciphertext = public.encrypt(payload, _OAEP)
    signature = key.sign(MESSAGE, _PSS, _SHA256)
    return {
        "keygen": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "encrypt": lambda: public.encrypt(payload, _OAEP),
        "decrypt": lambda: key.decrypt(ciphertext, _OAEP),
        "sign": lambda: key.sign(MESSAGE, _PSS, _SHA256),
        "verify": lambda: public.verify(signature, MESSAGE, _PSS, _SHA256),
    }


def _ecdsa_ops() -> dict[str, Op]:
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    signature = key.sign(MESSAGE, _ECDSA)
    return {
        "keygen": lambda: ec.generate_private_key(ec.SECP256R1()),
        "sign": lambda: key.sign(MESSAGE, _ECDSA),
        "verify": lambda: public.verify(signature, MESSAGE, _ECDSA),
    }


def _ed25519_ops() -> dict[str, Op]:
    key = ed25519.Ed25519PrivateKey.generate()
    public = key.public_key()
    signature = key.sign(MESSAGE)
    return {
        "keygen": ed25519.Ed25519PrivateKey.generate,
        "sign": lambda: key.sign(MESSAGE),
        "verify": lambda: public.verify(signature, MESSAGE),
    }


class _Gmssl:
    """The pure-Python ``gmssl`` package, as a reference. Its public key is set after
    construction: the constructor's ``lstrip("04")`` corrupts keys whose x starts with 0 or 4."""

    def __init__(self) -> None:
        from gmssl import sm2  # optional, test extra

        self._sm2 = sm2
        self._generator = f"{GX:064x}{GY:064x}"
        self.crypt = self.keygen()

    def keygen(self) -> Any:
        scalar = f"{secrets.randbelow(N - 2) + 1:064x}"
        crypt = self._sm2.CryptSM2(private_key=scalar, public_key="", mode=1)
        crypt.public_key = crypt._kg(int(scalar, 16), self._generator)
        return crypt

    def ops(self, payload: bytes) -> dict[str, Op]:
        crypt = self.crypt
        ciphertext = crypt.encrypt(payload)
        signature = crypt.sign_with_sm3(MESSAGE)
        return {
            "keygen": self.keygen,
            "encrypt": lambda: crypt.encrypt(payload),
            "decrypt": lambda: crypt.decrypt(ciphertext),
            "sign": lambda: crypt.sign_with_sm3(MESSAGE),
            "verify": lambda: crypt.verify_with_sm3(signature, MESSAGE),
        }


def _gmssl() -> _Gmssl | None:
    try:
        return _Gmssl()
    except ImportError:
        return None


def _rsa_hybrid_ops(key: rsa.RSAPrivateKey, payload: bytes) -> dict[str, Op]:
    """The service's RSA encryption: RSA-OAEP-SHA256 wraps a fresh AES-256-GCM key."""
    public = key.public_key()

    def unwrap(wrapped: bytes) -> bytes:
        return key.decrypt(wrapped, _OAEP)

    def wrap(dek: bytes) -> bytes:
        return public.encrypt(dek, _OAEP)

    def encrypt() -> bytes:
        return hybrid.seal(payload, b"", dek_size=32, wrap=wrap, aead=AesGcm)

    body = encrypt()
    return {
        "encrypt": encrypt,
        "decrypt": lambda: hybrid.open_(body, b"", dek_size=32, unwrap=unwrap, aead=AesGcm),
    }


def _sm2_hybrid_ops(key: Sm2Key, payload: bytes) -> dict[str, Op]:
    body = key.encrypt(payload, b"")
    return {
        "encrypt": lambda: key.encrypt(payload, b""),
        "decrypt": lambda: key.decrypt(body, b""),
    }


# --- the run ----------------------------------------------------------------------------------


def meta() -> dict[str, str | int]:
    from cryptography import __version__ as pyca_version
    from cryptography.hazmat.backends.openssl.backend import backend

    return {
        "python": platform.python_version(),
        # pyca's own OpenSSL (ML-DSA, ML-KEM, RSA, ECDSA, Ed25519); the system's for SM2
        "pyca": f"pyca/cryptography {pyca_version} ({backend.openssl_version_text()})",
        "libcrypto": _libcrypto.version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count() or 1,
    }


def run(
    seconds: float = 1.0,
    sizes: Iterable[int] = DEFAULT_SIZES,
    threads: int = 2,
    with_gmssl: bool = True,
    rounds: int = 3,
    progress: Callable[[Result], None] | None = None,
    classic: bool = True,
    post_quantum: bool = True,
) -> Report:
    """Measure everything; each figure gets ``seconds`` in total, spread over ``rounds``
    slices that alternate with the figures it is compared with. ``classic``: the SM2 tables;
    ``post_quantum``: the key types of :mod:`.pq`."""
    report = Report(seconds=seconds, meta=meta())

    def record(candidates: dict[str, tuple[Op, int]], operation: str, **extra: int) -> None:
        for label, (rate, iterations) in compare(candidates, seconds, rounds).items():
            backend, _, threads_ = label.partition("@")
            result = Result(
                backend, operation, rate, iterations, threads=int(threads_ or 1), **extra
            )
            report.results.append(result)
            if progress is not None:
                progress(result)

    if post_quantum:
        report.sizes = _post_quantum(record)
    if not classic:
        return report

    key_payload = secrets.token_bytes(KEY_PAYLOAD)
    sm2_key = sm2.load(sm2.generate())
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    gmssl = _gmssl() if with_gmssl else None

    main: dict[str, dict[str, Op]] = {
        "sm2": _sm2_ops(sm2_key, key_payload),
        "rsa-2048": _rsa_ops(rsa_key, key_payload),
        "ecdsa-p256": _ecdsa_ops(),
        "ed25519": _ed25519_ops(),
    }
    if gmssl is not None:
        main["gmssl"] = gmssl.ops(key_payload)
    rsa_private = main["rsa-2048"]["sign"]
    for operation in OPERATIONS:
        candidates = {b: (ops[operation], 1) for b, ops in main.items() if operation in ops}
        if operation in REFERENCE_OPERATIONS:
            candidates[RSA_PRIVATE] = (rsa_private, 1)
        record(candidates, operation)

    for size in sizes:
        payload = secrets.token_bytes(size)
        by_size: dict[str, dict[str, Op]] = {
            "sm2-hybrid": _sm2_hybrid_ops(sm2_key, payload),
            "rsa-2048-hybrid": _rsa_hybrid_ops(rsa_key, payload),
            "sm2-raw": _sm2_ops(sm2_key, payload),
        }
        if gmssl is not None:
            by_size["gmssl-raw"] = gmssl.ops(payload)
        for operation in ("encrypt", "decrypt"):
            candidates = {b: (ops[operation], 1) for b, ops in by_size.items()}
            record(candidates, operation, payload=size)

    if threads > 1:
        # one thread and several, alternating: the speed-up shows the GIL is released
        for operation in REFERENCE_OPERATIONS:
            op = main["sm2"][operation]
            record({f"{THREADS}@1": (op, 1), f"{THREADS}@{threads}": (op, threads)}, operation)
    return report


def _post_quantum(record: Callable[..., None]) -> dict[str, dict[str, Any]]:
    """Each operation across every key type that has it, in alternating slices; the sizes
    (bytes) per key type."""
    signing, signing_sizes = pq.candidates(pq.SIGNING, pq.signing_ops)
    reference = pq.reference_ops()
    if reference is not None:
        signing[pq.REFERENCE] = reference
    for operation in pq.SIGN_OPERATIONS:
        record({name: (ops[operation], 1) for name, ops in signing.items()}, operation)
    encrypting, encrypting_sizes = pq.candidates(pq.ENCRYPTING, pq.encrypting_ops)
    for operation in pq.ENCRYPT_OPERATIONS:
        having = {name: (ops[operation], 1) for name, ops in encrypting.items() if operation in ops}
        record(having, operation)
    return pq.merge_sizes(signing_sizes, encrypting_sizes)


# --- derived figures --------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(report: Report) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for operation in OPERATIONS:
        sm2 = report.rate("sm2", operation)
        out[operation] = {
            "sm2/rsa-2048": ratio(sm2, report.rate("rsa-2048", operation)),
            "sm2/gmssl": ratio(sm2, report.rate("gmssl", operation)),
        }
    return out


def references(report: Report) -> list[dict[str, Any]]:
    """SM2 against its references, per operation: the ratio to gmssl and to RSA-2048's
    private-key operation, measured alongside it in the same alternating slices."""
    out = []
    for operation in REFERENCE_OPERATIONS:
        sm2 = report.rate("sm2", operation)
        rsa_private = report.rate(RSA_PRIVATE, operation)
        out.append(
            {
                "operation": operation,
                "sm2": sm2,
                "rsa_private": rsa_private,
                "vs_gmssl": ratio(sm2, report.rate("gmssl", operation)),
                "vs_rsa_private": ratio(sm2, rsa_private),
            }
        )
    return out
