"""The host's phase: how fast this machine runs right now, named in every result.

The same VM kind has been measured ~3x slower in some phases than in others (OpenSSL's
big-number code and CPython slow more than Go), so a figure means little without it. The
indicator is the time of one RSA-2048 PSS signature (pyca/cryptography) in a bare loop:
~300 us in the fast phase here, ~1,100 us in the slow one.

    python -m loadtest.phase
"""

from __future__ import annotations

import statistics
import time

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa


def rsa_sign_us(seconds: float = 1.0, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean RSA-2048 PSS-SHA256 signing time (microseconds)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
    message = b"x" * 32
    means = []
    for _ in range(rounds):
        count = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds / rounds:
            key.sign(message, pss, hashes.SHA256())
            count += 1
        means.append(elapsed / count * 1e6)
    return round(statistics.median(means), 1)


def describe(us: float) -> str:
    return f"RSA-2048 PSS sign {us:.0f} us in a bare loop"


if __name__ == "__main__":
    print(describe(rsa_sign_us()))
