"""Per-client token buckets shared by every server worker of one host, without a server.

The same LMDB setup as the host replay store (service/auth/replay_host.py), in a file of its
own beside it: one write transaction per request reads and updates the client's bucket, so a
client that spreads its connections over the workers gets the configured rate, not that rate
once per worker. The clock is CLOCK_MONOTONIC, which every process of the host shares.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Final

import lmdb

from service.auth.ratelimit import MemoryRateLimiter, default_burst
from service.auth.replay_host import ReplayStoreError, boot_id, private_directory
from service.errors import RateLimited

_BUCKET: Final = struct.Struct(">dd")  # tokens, at
MAP_BYTES: Final = 16 * 1024 * 1024  # a bucket per configured client: a few hundred bytes each


class HostRateLimiter:
    def __init__(self, directory: Path, rate: float, burst: int = 0) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive (a rate of 0 disables limiting: use None)")
        self.rate = rate
        self.burst = default_burst(rate, burst)
        # If the file cannot answer (it never should), each process limits on its own.
        self._fallback = MemoryRateLimiter(rate, burst)
        path = private_directory(directory) / f"{boot_id()}.ratelimit.lmdb"
        try:
            self._env = lmdb.open(
                str(path),
                subdir=False,
                map_size=MAP_BYTES,
                max_dbs=0,
                mode=0o600,
                sync=False,
                metasync=False,
                readahead=False,
                lock=True,
            )
        except lmdb.Error as exc:
            raise ReplayStoreError(f"rate-limit store {path}: {exc}") from exc

    async def acquire(self, client_id: str) -> None:
        self.acquire_now(client_id, time.monotonic())

    def acquire_now(self, client_id: str, now: float) -> None:
        key = client_id.encode()
        try:
            with self._env.begin(write=True) as txn:
                held = txn.get(key)
                tokens, at = (float(self.burst), now) if held is None else _BUCKET.unpack(held)
                tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
                allowed = tokens >= 1.0
                txn.put(key, _BUCKET.pack(tokens - 1.0 if allowed else tokens, now))
        except lmdb.Error:
            self._fallback.acquire_now(client_id, now)
            return
        if not allowed:
            raise RateLimited(retry_after=(1.0 - tokens) / self.rate)

    async def aclose(self) -> None:
        self._env.close()
