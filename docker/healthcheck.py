"""Container HEALTHCHECK: GET /healthz on the local port; exit 0 only on a 200 answer.

The slim base image has no curl, so the check is a few lines of standard-library Python.
It runs with the container's environment, so it follows the server's own settings:
CRYPTD_HOST and CRYPTD_PORT, and HTTPS whenever the server serves TLS (CRYPTD_TLS_CERT_FILE
set and CRYPTD_TLS not "off"; production refuses plain HTTP otherwise).

Over HTTPS the check does not verify the server's certificate, as the kubelet's HTTPS probes
do not: it asks the server in its own container, on loopback, whether it answers, and the
certificate names the Service (cryptd.cryptd.svc), not the loopback address. The handshake
itself is the server's own (TLS 1.2 at least). With mutual TLS and
CRYPTD_TLS_CLIENT_CERT=required no handshake completes without a client certificate: set
CRYPTD_TLS_CLIENT_CERT=optional, as the kubelet's probes need too (docs/DEPLOY.md).
"""

from __future__ import annotations

import http.client
import os
import ssl
import sys

# Addresses that mean "every interface": probe them on loopback.
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def probe_target(env: dict[str, str]) -> tuple[str, int]:
    host = env.get("CRYPTD_HOST", "127.0.0.1").strip()
    if host in _WILDCARDS:
        host = "127.0.0.1"
    return host.strip("[]"), int(env.get("CRYPTD_PORT", "8080"))


def uses_tls(env: dict[str, str]) -> bool:
    """Whether the server serves HTTPS, decided as `cryptd serve` decides it."""
    if env.get("CRYPTD_TLS", "").strip().lower() == "off":
        return False
    return bool(env.get("CRYPTD_TLS_CERT_FILE", "").strip())


def _probe_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # Liveness of the local server, not its identity (see the module's docstring).
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def probe(host: str, port: int, *, tls: bool = False, timeout: float = 2.0) -> str | None:
    """None when /healthz answers 200, else why not (one line, for the engine's health log)."""
    conn: http.client.HTTPConnection
    if tls:
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=_probe_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/healthz", headers={"User-Agent": "cryptd-healthcheck"})
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        conn.close()
    return None if status == 200 else f"HTTP {status}"


def check(host: str, port: int, *, tls: bool = False, timeout: float = 2.0) -> bool:
    return probe(host, port, tls=tls, timeout=timeout) is None


def main() -> int:
    env = dict(os.environ)
    try:
        host, port = probe_target(env)
    except ValueError:
        print("healthcheck: CRYPTD_PORT is not a number", file=sys.stderr)
        return 1
    tls = uses_tls(env)
    problem = probe(host, port, tls=tls)
    if problem is None:
        return 0
    scheme = "https" if tls else "http"
    print(f"healthcheck: {scheme}://{host}:{port}/healthz: {problem}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
