"""The test bed's topology and settings: machine names and addresses, URLs, the run
directory's layout (``Bed``); the machines themselves are started by ``testbed_services``."""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from loadtest.testbed_net import Node

DEFAULT_RUN_DIR: Final = Path("/tmp/cryptd-testbed")  # noqa: S108 - root's bed, fixed so down finds it
DEFAULT_PREFIX: Final = "cbed"
DEFAULT_SUBNET: Final = "10.231.0"
CRYPTD_PORT: Final = 8080
REDIS_PORT: Final = 6379
SENTINEL_PORT: Final = 26379
PG_PORT: Final = 5432
REDIS_SERVICE: Final = "cryptd"  # the Sentinel master name
DATABASE: Final = "cryptd"
CLIENT_ID: Final = "bed"
# Each cryptd host's tmpfs: a whole campaign's audit trail (~16 MB a host, every refused replay
# audited) fits with room to spare, and filling it (the disk-full fault) is still quick.
HOST_DISK: Final = "96m"
FAKETIME_LIBS: Final = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
)
STARTUP_TIMEOUT: Final = 60.0

# The machines and the last byte of their addresses.
ROLES: Final = {
    "lb": 10,
    "app1": 11,
    "app2": 12,
    "app3": 13,
    "pg1": 21,
    "pg2": 22,
    "redis1": 31,
    "redis2": 32,
    "sentinel1": 41,
    "sentinel2": 42,
    "sentinel3": 43,
}
APPS: Final = ("app1", "app2", "app3")
PGS: Final = ("pg1", "pg2")
REDISES: Final = ("redis1", "redis2")
SENTINELS: Final = ("sentinel1", "sentinel2", "sentinel3")

# libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC answers EINVAL to the absolute
# clock_nanosleep that Python's time.sleep uses (measured here); Event.wait and the event loop's
# timers are unaffected. The cryptd hosts import this first (PYTHONPATH) so time.sleep waits on
# an event instead: the wall clock moves, CLOCK_MONOTONIC never does, as with a real clock step.
SITECUSTOMIZE: Final = '''"""Test bed: time.sleep as a condition wait (loadtest/testbed.py)."""
import threading
import time

_never = threading.Event()


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _never.wait(seconds)


time.sleep = _sleep
'''


@dataclass
class Bed:
    run_dir: Path = DEFAULT_RUN_DIR
    prefix: str = DEFAULT_PREFIX
    subnet: str = DEFAULT_SUBNET
    workers: int = 2
    redis_mode: str = "direct"  # "direct": redis:// to the primary; "sentinel": redis+sentinel://
    pg_sync: bool = True  # synchronous_standby_names = 'ANY 1 (*)' on the primary
    # CRYPTD_SIGNATURE_MAX_SKEW of every host (None: cryptd's default, 5 s). A Redis failover's
    # refusal window ends at the new primary's epoch plus this (docs/SCALE.md).
    max_skew: int | None = None
    sentinel_down_after_ms: int = 1000  # Sentinel's down-after-milliseconds (detection)
    python: str = sys.executable

    # Topology ---------------------------------------------------------------------------

    def node(self, role: str) -> Node:
        return Node(role, ROLES[role], self.prefix, self.subnet)

    @property
    def url(self) -> str:
        """Where clients reach the service: the load balancer."""
        return f"http://{self.node('lb').address}:{CRYPTD_PORT}"

    def host_url(self, app: str) -> str:
        return f"http://{self.node(app).address}:{CRYPTD_PORT}"

    def redis_url(self) -> str:
        """The one place the bed's cryptd learns where its replay store is."""
        if self.redis_mode == "sentinel":
            seeds = ",".join(f"{self.node(s).address}:{SENTINEL_PORT}" for s in SENTINELS)
            return f"redis+sentinel://{seeds}/{REDIS_SERVICE}"
        return f"redis://{self.node('redis1').address}:{REDIS_PORT}/0"

    def keystore_url(self) -> str:
        hosts = ",".join(f"{self.node(p).address}:{PG_PORT}" for p in PGS)
        # sslmode=disable: the bed's bridge is a private network (production: verify-full).
        return (
            f"postgresql://postgres@{hosts}/{DATABASE}"
            "?target_session_attrs=read-write&sslmode=disable&connect_timeout=2"
        )

    def directory(self, role: str) -> Path:
        return self.run_dir / role

    @property
    def credential(self) -> Path:
        return self.run_dir / "client.json"

    def faketime_file(self, app: str) -> Path:
        return self.directory(app) / "faketime"

    def disk(self, app: str) -> Path:
        return self.directory(app) / "var"

    # State ------------------------------------------------------------------------------

    def save(self) -> None:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        (self.run_dir / "state.json").write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> Bed:
        data = json.loads((run_dir / "state.json").read_text())
        data["run_dir"] = Path(data["run_dir"])
        return cls(**data)

    def secret(self) -> bytes:
        return base64.b64decode(json.loads(self.credential.read_text())["secret"])
