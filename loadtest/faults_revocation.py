"""Revocation across hosts, measured round after round while the campaign runs.

A round: create a key on one host, have every worker of every host encrypt under it (one
kept-alive connection pinned to each worker, found through ``/readyz``'s worker index), set it
``disabled`` with a PATCH on one host, and the moment that answer arrives let every worker's
probe encrypt under it until refused. Recorded: the time from the answer to the last worker's
first refusal back (an upper bound: the probe's round trip is in it) and any encryption sent
after the answer that was served (goal 0). A worker that cannot be reached (its host killed or
cut off) sits the round out and is counted.
"""

from __future__ import annotations

import base64
import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from service.auth.signature import sign_request

PLAINTEXT = base64.b64encode(b"revocation probe").decode()
PROBE_TIMEOUT = 10.0


@dataclass
class Lane:
    name: str
    conn: httpx.Client
    client_id: str
    secret: bytes

    def send(self, method: str, path: str, body: Any = None) -> httpx.Response:
        content = b"" if body is None else orjson.dumps(body)
        headers = sign_request(method, path, "", content, self.client_id, self.secret)
        return self.conn.request(method, path, content=content, headers=headers)

    def encrypt(self, key: str) -> int:
        return self.send("POST", f"/v1/encrypt/{key}", {"plaintext": PLAINTEXT}).status_code


@dataclass
class Round:
    phase: str
    seconds: float  # answer -> last worker's first refusal
    served_after: int
    lanes: int
    absent: int  # workers that could not be reached this round


@dataclass
class Revocation:
    hosts: dict[str, str]  # host name -> URL
    workers: int
    client_id: str
    secret: bytes
    phase: str = "steady"
    rounds: list[Round] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="revocation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            phase = self.phase
            try:
                with self._lanes() as (lanes, absent):
                    if len(lanes) >= 2:
                        self.rounds.append(self._round(lanes, absent, n, phase))
            except (httpx.HTTPError, RuntimeError) as exc:
                self.errors.append(f"{phase}: {type(exc).__name__}: {exc}"[:200])
            n += 1
            self._stop.wait(0.2)

    @contextlib.contextmanager
    def _lanes(self) -> Iterator[tuple[list[Lane], int]]:
        """A pinned connection to every worker reachable now, and how many were not."""
        opened: list[httpx.Client] = []
        lanes: list[Lane] = []
        absent = 0
        try:
            for host, url in self.hosts.items():
                found: dict[int, httpx.Client] = {}
                for _ in range(self.workers * 8):
                    if len(found) == self.workers:
                        break
                    conn = httpx.Client(
                        base_url=url, timeout=2, limits=httpx.Limits(max_connections=1)
                    )
                    opened.append(conn)
                    try:
                        answer = conn.get("/readyz")
                        index = answer.json()["checks"]["server"]["worker"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        break
                    found.setdefault(index, conn)
                absent += self.workers - len(found)
                lanes += [
                    Lane(f"{host}/{i}", c, self.client_id, self.secret) for i, c in found.items()
                ]
            yield lanes, absent
        finally:
            for conn in opened:
                conn.close()

    def _round(self, lanes: list[Lane], absent: int, n: int, phase: str) -> Round:
        key = f"rv-{secrets.token_hex(4)}-{n}"
        acting = lanes[n % len(lanes)]
        answer = acting.send("POST", f"/v1/keys/{key}", {"type": "aes256-gcm"})
        if answer.status_code != 201:
            raise RuntimeError(f"create answered {answer.status_code}")
        live = []
        for lane in lanes:
            deadline = time.monotonic() + PROBE_TIMEOUT
            with contextlib.suppress(httpx.HTTPError):
                while lane.encrypt(key) != 200 and time.monotonic() < deadline:
                    time.sleep(0.02)
                live.append(lane)
        answer = acting.send("PATCH", f"/v1/keys/{key}", {"state": "disabled"})
        answered = time.monotonic()
        if answer.status_code != 200:
            raise RuntimeError(f"disable answered {answer.status_code}")
        refused_at: dict[str, float] = {}
        served = [0]

        def probe(lane: Lane) -> None:
            deadline = time.monotonic() + PROBE_TIMEOUT
            with contextlib.suppress(httpx.HTTPError):
                while time.monotonic() < deadline:
                    status = lane.encrypt(key)
                    if status == 200:
                        served[0] += 1
                        continue
                    refused_at[lane.name] = time.monotonic()
                    return

        threads = [threading.Thread(target=probe, args=(lane,)) for lane in live]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        missing = len(live) - len(refused_at)
        last = max(refused_at.values(), default=answered)
        return Round(phase, last - answered, served[0], len(refused_at), absent + missing)
