"""Container HEALTHCHECK: GET /healthz on the local port; exit 0 only on a 200 answer.

The slim base image has no curl, so the check is a few lines of standard-library Python.
It runs with the container's environment, so it follows CRYPTD_HOST and CRYPTD_PORT.
"""

from __future__ import annotations

import http.client
import os
import sys

# Addresses that mean "every interface": probe them on loopback.
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def probe_target(env: dict[str, str]) -> tuple[str, int]:
    host = env.get("CRYPTD_HOST", "127.0.0.1").strip()
    if host in _WILDCARDS:
        host = "127.0.0.1"
    return host.strip("[]"), int(env.get("CRYPTD_PORT", "8080"))


def check(host: str, port: int, timeout: float = 2.0) -> bool:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/healthz", headers={"User-Agent": "cryptd-healthcheck"})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def main() -> int:
    try:
        host, port = probe_target(dict(os.environ))
    except ValueError:
        print("healthcheck: CRYPTD_PORT is not a number", file=sys.stderr)
        return 1
    return 0 if check(host, port) else 1


if __name__ == "__main__":
    sys.exit(main())
