"""Revocation across hosts, measured round after round while the campaign runs.

A round: create a key on one host, have every worker of every host encrypt under it (one
kept-alive connection pinned to each worker, found through ``/readyz``'s worker index), set it
``disabled`` with a PATCH on one host, and the moment that answer arrives release every
worker's probe (threads started before the PATCH, waiting on an event) to encrypt under it
until refused with ``409 key_disabled``; any other answer (served, 503 overloaded, 429) is
recorded and the probe sent again.

What the probes mean is read by :mod:`loadtest.faults_revocation_lanes`: the property is that
no worker *serves* the key after the answer, and a worker refusing every request (a Redis
failover's 503s) refuses the key too. Recorded per round, so that the mechanism and the probes
are told apart:

- ``propagation`` ("after the answer"): until the last worker's refusal was *sent*, a refusal
  of any kind counting, provided the worker served nothing after it; a worker that refused its
  first probe counts 0 (that send time is this thread's wake-up: the answer waits for every
  replica's confirmation, so the change was in force when it left);
- ``seconds`` (the probe bound): until that refusal came back, with the probe's round trip
  (and, on a busy machine, the wait for this process's GIL and CPU) in it;
- ``probe_rtt``: the slowest of those refused probes, sent to answered;
- ``unrelated_first``, ``key_disabled_after``: the workers whose first answer was a refusal
  that says nothing about the key, and the time until every worker was seen answering
  ``key_disabled`` (the figure this report gave as "after the answer" before);
- ``served_after``: encryptions sent after the answer that were served (goal 0), and
  ``served_after_refusal``: workers that served one after having refused (goal 0);
- ``confirmed``, ``replicas``, ``waited``: the PATCH answer's ``X-Cryptd-Propagation`` (the
  product's own statement that every live replica enforced the change before it answered, and
  how long that took from the commit).

A worker that cannot be reached (its host killed or cut off) sits the round out and is counted.
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

from loadtest.faults_revocation_lanes import Probe, figures, read_lane
from service.auth.signature import sign_request

PLAINTEXT = base64.b64encode(b"revocation probe").decode()
PROBE_TIMEOUT = 10.0
CHANGE_TIMEOUT = 10.0  # a key change's answer (the server waits at most 7 s for replicas)


@dataclass
class Lane:
    name: str
    conn: httpx.Client
    client_id: str
    secret: bytes

    def send(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None
    ) -> httpx.Response:
        content = b"" if body is None else orjson.dumps(body)
        headers = sign_request(method, path, "", content, self.client_id, self.secret)
        return self.conn.request(
            method,
            path,
            content=content,
            headers=headers,
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
        )

    def encrypt(self, key: str) -> int:
        return self.send("POST", f"/v1/encrypt/{key}", {"plaintext": PLAINTEXT}).status_code

    def verdict(self, key: str) -> tuple[int, str]:
        """The status and error code of one encryption under ``key`` ("" when served)."""
        answer = self.send("POST", f"/v1/encrypt/{key}", {"plaintext": PLAINTEXT})
        if answer.status_code == 200:
            return 200, ""
        try:
            code = str(orjson.loads(answer.content)["error"]["code"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            code = ""
        return answer.status_code, code


def parse_propagation(header: str | None) -> dict[str, float]:
    """``X-Cryptd-Propagation``'s numbers (replicas, confirmed, waited); {} when absent."""
    found: dict[str, float] = {}
    for item in (header or "").split(","):
        name, _, value = item.strip().partition("=")
        if name in ("replicas", "confirmed", "waited"):
            with contextlib.suppress(ValueError):
                found[name] = float(value)
    return found


@dataclass
class Round:
    phase: str
    seconds: float  # answer -> last worker's counted refusal back (probe round trip in it)
    served_after: int
    lanes: int
    absent: int  # workers that could not be reached this round
    propagation: float = float("nan")  # answer -> last worker's counted refusal sent (0: first)
    probe_rtt: float = float("nan")  # the slowest counted refusal, sent -> answered
    replicas: int = 0  # the PATCH answer's X-Cryptd-Propagation
    confirmed: int = 0
    waited: float = float("nan")  # the answer's wait for the other replicas (commit on)
    other_refusals: int = 0  # probes refused for something else than the key (503, 429)
    first_refused: int = 0  # workers that refused (for any reason) their first probe
    unrelated_first: int = 0  # ... whose refusal was not key_disabled
    key_disabled_after: float = float("nan")  # answer -> last worker's key_disabled sent
    served_after_refusal: int = 0  # workers that served the key after having refused it


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
        seen: dict[str, list[Probe]] = {lane.name: [] for lane in live}
        go = threading.Event()
        answered = [0.0]

        def probe(lane: Lane) -> None:
            if not go.wait(PROBE_TIMEOUT):
                return
            deadline = answered[0] + PROBE_TIMEOUT
            probes = seen[lane.name]
            with contextlib.suppress(httpx.HTTPError):
                while time.monotonic() < deadline:
                    sent = time.monotonic()
                    status, code = lane.verdict(key)
                    probes.append(Probe(sent, time.monotonic(), status, code))
                    if probes[-1].key_disabled:
                        return
                    time.sleep(0.02)

        # Started before the PATCH, released by its answer: no thread start in the figures.
        threads = [threading.Thread(target=probe, args=(lane,)) for lane in live]
        for thread in threads:
            thread.start()
        try:
            # The answer waits for a replica that went silent until it is forgotten (its lease
            # ran out): up to the server's propagation timeout, 7 s.
            answer = acting.send(
                "PATCH", f"/v1/keys/{key}", {"state": "disabled"}, timeout=CHANGE_TIMEOUT
            )
        finally:
            answered[0] = time.monotonic()
            go.set()
            for thread in threads:
                thread.join()
        if answer.status_code != 200:
            raise RuntimeError(f"disable answered {answer.status_code}")
        header = parse_propagation(answer.headers.get("x-cryptd-propagation"))
        read = [w for probes in seen.values() if (w := read_lane(probes, answered[0])) is not None]
        f = figures(read)
        return Round(
            phase,
            f.seconds,
            f.served_after,
            f.lanes,
            absent + len(live) - f.lanes,
            propagation=f.propagation,
            first_refused=f.first_refused,
            probe_rtt=f.probe_rtt,
            replicas=int(header.get("replicas", 0)),
            confirmed=int(header.get("confirmed", 0)),
            waited=header.get("waited", float("nan")),
            other_refusals=f.other_refusals,
            unrelated_first=f.unrelated_first,
            key_disabled_after=f.key_disabled_after,
            served_after_refusal=f.served_after_refusal,
        )
