"""Graceful shutdown under load: SIGTERM while signed requests are in flight loses none of the
requests sent before it.

This is what a pod goes through on every rollout, scale-in and node drain: the kubelet runs
the preStop hook, then sends SIGTERM; uvicorn stops accepting, finishes what it has, exits.

A real `cryptd serve --dev` process on a free loopback port; several client threads, each with
its own keep-alive connection, send signed requests without pause (AES-GCM encryptions and
RSA signing batches that run on the worker pool); one long RSA-4096 signing batch is sent just
before the signal so that a request is certainly being worked on when it arrives.

What counts as lost: a response other than 2xx, the long request not answered in full, a
cancelled task in the server log, or a connection dropped under a request sent before the
signal, even one whose bytes the server had not read yet because its connection looked idle
(service/edge/protocol.py, "Shutdown"). A request sent after the signal may meet its
connection half-closed (a clean EOF, HTTP/1.1's race, RFC 9112 §9.3.1), each client at most
once, because the listening socket is closed first.

The focused tests below hold the server still (SIGSTOP) so that a request's bytes wait unread
in its socket with the shutdown due, as on a loop busy with others.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from service.auth.signature import sign_request
from tests.conftest import Server, start_server, stop_server
from tests.rawhttp import ResponseReader, connect, head_bytes
from tests.test_k8s_support import require_cli

pytestmark = pytest.mark.slow

CLIENTS = 6
# Time the process has after SIGTERM in the pod: terminationGracePeriodSeconds - preStop.
GRACE_SECONDS = 40
WARM_UP_RESPONSES = 300
LONG_BATCH = 1000  # the default batch limit


@dataclass
class Outcome:
    started: float
    ended: float
    status: int | None = None
    error: str | None = None


@dataclass
class Load:
    server: Server
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: dict[int, list[Outcome]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(
        self, client: httpx.Client, path: str, body: object, sent: threading.Event | None = None
    ) -> httpx.Response:
        """``sent`` is set once the request's last byte is written."""
        content = orjson.dumps(body)
        headers = sign_request("POST", path, "", content, self.server.client_id, self.server.secret)
        headers["X-Request-ID"] = uuid.uuid4().hex

        def trace(event: str, info: object) -> None:
            if sent is not None and event == "http11.send_request_body.complete":
                sent.set()

        return client.post(
            self.server.url + path, content=content, headers=headers, extensions={"trace": trace}
        )

    def responses(self) -> int:
        with self.lock:
            return sum(1 for runs in self.outcomes.values() for o in runs if o.status)

    def run_client(self, number: int) -> None:
        runs: list[Outcome] = []
        with self.lock:
            self.outcomes[number] = runs
        message = base64.b64encode(os.urandom(64)).decode()
        with httpx.Client(timeout=GRACE_SECONDS) as client:
            while not self.stop.is_set():
                if number % 3 == 0:
                    path = "/v1/sign/rsa-2048"
                    body: object = {"batch": [{"message": message}] * 20}
                else:
                    path, body = "/v1/encrypt/aes256-gcm", {"plaintext": message}
                outcome = Outcome(started=time.monotonic(), ended=0.0)
                try:
                    outcome.status = self.send(client, path, body).status_code
                except httpx.ConnectError:
                    outcome.error = "refused"
                except httpx.TransportError as exc:
                    outcome.error = type(exc).__name__
                outcome.ended = time.monotonic()
                with self.lock:
                    runs.append(outcome)
                if outcome.error == "refused":
                    return  # the server no longer accepts connections: done


def test_sigterm_under_load_drops_no_accepted_request(tmp_path: Path) -> None:
    require_cli()
    # The drain is under test, not the pool's deadline: on a busy machine the long batch may
    # take longer than the default 5 s, which would answer 503 before the signal matters.
    server = start_server(tmp_path, {"CRYPTD_LOG_LEVEL": "info", "CRYPTD_POOL_DEADLINE": "30"})
    load = Load(server)
    threads = [
        threading.Thread(target=load.run_client, args=(n,), daemon=True) for n in range(CLIENTS)
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while load.responses() < WARM_UP_RESPONSES and time.monotonic() < deadline:
            time.sleep(0.05)
        assert load.responses() >= WARM_UP_RESPONSES, server.log()[-2000:]

        long_result: dict[str, httpx.Response | BaseException] = {}
        long_ended: list[float] = []
        long_sent = threading.Event()

        def long_request() -> None:
            messages = [{"message": base64.b64encode(os.urandom(32)).decode()}] * LONG_BATCH
            with httpx.Client(timeout=GRACE_SECONDS) as client:
                try:
                    long_result["response"] = load.send(
                        client, "/v1/sign/rsa-4096", {"batch": messages}, long_sent
                    )
                except httpx.TransportError as exc:
                    long_result["response"] = exc
                long_ended.append(time.monotonic())

        long_thread = threading.Thread(target=long_request, daemon=True)
        long_thread.start()
        # Sent (on a busy machine the thread may take longer than the pause below to get
        # there), then being worked on: 1,000 RSA-4096 signatures take longer than the pause.
        assert long_sent.wait(GRACE_SECONDS), f"long request not sent: {long_result}"
        time.sleep(0.3)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        try:
            returncode = server.process.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {GRACE_SECONDS} s after SIGTERM: the kubelet kills it")
        load.stop.set()
        long_thread.join(timeout=GRACE_SECONDS)
        for thread in threads:
            thread.join(timeout=GRACE_SECONDS)
    finally:
        load.stop.set()
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()

    log = server.log()
    # A clean drain is a clean exit (status 0); a kill mid-drain would not log the last line.
    assert returncode == 0, log[-2000:]
    assert "Finished server process" in log, log[-2000:]
    assert "timeout graceful shutdown exceeded" not in log

    response = long_result.get("response")
    assert isinstance(response, httpx.Response), f"long request lost: {response!r}"
    assert response.status_code == 200, response.text
    results = response.json()["batch"]
    assert len(results) == LONG_BATCH
    assert all("signature" in item for item in results)
    assert long_ended[0] > signalled, "the long request ended before SIGTERM: nothing drained"

    outcomes = [o for runs in load.outcomes.values() for o in runs]
    statuses = [o.status for o in outcomes if o.status is not None]
    assert statuses, "no response at all"
    assert all(200 <= s < 300 for s in statuses), sorted(set(statuses))
    drained = [o for o in outcomes if o.status and o.started < signalled < o.ended]
    assert drained, "no request was in flight at SIGTERM: the test proved nothing"
    # A request sent before the signal is answered even when its connection looked idle then
    # (its bytes unread); after the signal a client may meet its connection's clean EOF once.
    for number, runs in load.outcomes.items():
        dropped = [o for o in runs if o.error not in (None, "refused")]
        assert len(dropped) <= 1, f"client {number} lost {len(dropped)} requests: {dropped}"
        for outcome in dropped:
            assert outcome.started >= signalled, f"lost a request sent before SIGTERM: {outcome}"


def signed_request(server: Server) -> bytes:
    """An AES-GCM encryption request's bytes, signed."""
    path = "/v1/encrypt/aes256-gcm"
    content = orjson.dumps({"plaintext": base64.b64encode(b"drain").decode()})
    headers = sign_request("POST", path, "", content, server.client_id, server.secret)
    headers["Content-Length"] = str(len(content))
    return head_bytes("POST", path, headers) + content


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_request_unread_when_the_drain_begins_is_answered(tmp_path: Path, tls: bool) -> None:
    """The request is in the server's socket, unread, and its kept-alive connection looks idle
    when the drain begins: it is answered with ``connection: close``, not cut off."""
    require_cli()
    server = start_server(tmp_path, tls=tls)
    verify = server.verify()
    context = verify if not isinstance(verify, bool) else None
    try:
        with connect(server.url, context=context) as sock:
            reader = ResponseReader(sock)
            sock.sendall(signed_request(server))
            assert reader.read().status == 200  # the connection is kept alive, idle
            # Held still, the server reads nothing: the request waits in its socket. Stopped
            # longer than uvicorn's 0.1 s tick, it resumes with the shutdown due; whether its
            # loop runs that or reads the socket first varies from run to run (uvicorn's
            # close reset the request in about a third of the runs), answered either way.
            server.process.send_signal(signal.SIGSTOP)
            try:
                sock.sendall(signed_request(server))
                time.sleep(0.3)
                server.process.send_signal(signal.SIGTERM)
            finally:
                server.process.send_signal(signal.SIGCONT)
            response = reader.read()
            assert response.status == 200, response.body
            assert response.headers["connection"] == "close"
            assert reader.closed()
        assert server.process.wait(timeout=GRACE_SECONDS) == 0, server.log()[-2000:]
    finally:
        stop_server(server)


def test_an_idle_connection_is_half_closed_and_drained(tmp_path: Path) -> None:
    """An idle kept-alive connection gets a clean EOF at SIGTERM; a request sent on it after
    that (the client had not seen the EOF yet) is read and dropped, not answered with a reset,
    and the connection ends when the client closes it."""
    require_cli()
    server = start_server(tmp_path)
    try:
        with connect(server.url) as sock:
            reader = ResponseReader(sock)
            sock.sendall(signed_request(server))
            assert reader.read().status == 200
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            sock.settimeout(10)
            assert sock.recv(1) == b"", "an answer on an idle connection"
            eof_after = time.monotonic() - signalled
            sock.sendall(signed_request(server))
            time.sleep(0.2)  # a reset, had the server closed the socket, would be here now
            # recv() reports EOF even after a reset; the socket's error says whether one came.
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "reset"
            assert sock.recv(1) == b""
        assert server.process.wait(timeout=GRACE_SECONDS) == 0, server.log()[-2000:]
        assert eof_after < 5, f"the idle connection was held {eof_after:.2f} s"
    finally:
        stop_server(server)
