"""What every server of a benchmark needs before it starts: a free loopback port, and the
replay store that several cryptd workers share (the host's file, or a Redis)."""

from __future__ import annotations

import socket
from typing import Final

DEFAULT_REDIS: Final = "redis://127.0.0.1:6379/0"


def free_port(pair: bool = False) -> int:
    """A free loopback port; with ``pair``, one whose successor is free too (OpenBao's dev
    mode binds its cluster listener on port + 1)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not pair:
            return port
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair")


def redis_url(choice: str) -> str | None:
    if choice == "none":
        return None
    url = DEFAULT_REDIS if choice == "auto" else choice
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception as exc:
        if choice != "auto":
            raise SystemExit(f"Redis at {url} is not reachable: {exc}") from exc
        return None
    return url


def cryptd_env(workers: int, redis: str | None) -> dict[str, str]:
    # Several workers share the host's replay store unless the run names a Redis (the store
    # replicas share); one worker never needs it.
    return {"CRYPTD_REDIS_URL": redis} if workers > 1 and redis else {}
