"""The audit trail of a running server: one durable record per API request, fail-closed
answers, /readyz, recovery without a restart, and a SIGKILL under load losing nothing."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.test_keystore_support import fill, needs_root, needs_tool

pytestmark = pytest.mark.slow

PLAINTEXT = "AUDIT-PLAINTEXT-5e0d1"
AAD = "AUDIT-AAD-77f2"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def audit_files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.iterdir() if p.name.startswith("audit.log"))


def audit_records(directory: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for name in audit_files(directory)
        for line in Path(name).read_bytes().splitlines()
    ]


def cli_verify(server: Server, files: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    dev = server.directory / "dev"
    return subprocess.run(
        [sys.executable, "-m", "service", "audit", "verify", *files, *extra,
         "--keyring", str(dev / "keyring.json"), "--master-key-file", str(dev / "master.key")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def call(server: Server, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    request_id = kw.pop("request_id", None) or uuid.uuid4().hex
    return server.request(method, path, body, headers={"X-Request-ID": request_id}, **kw)


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    directory = tmp_path_factory.mktemp("audited")
    logs = directory / "audit"
    logs.mkdir()
    server = start_server(
        directory,
        {
            "CRYPTD_AUDIT_LOG": str(logs / "audit.log"),
            "CRYPTD_AUDIT_FAIL_CLOSED": "true",
            "CRYPTD_AUDIT_CHECKPOINT_INTERVAL": "0.5",
        },
    )
    yield server, logs
    stop_server(server)


def test_every_api_request_has_exactly_one_record(audited: tuple[Server, Path]) -> None:
    server, logs = audited
    ids: dict[str, tuple[str, int]] = {}

    def sent(name: str, response: httpx.Response, status: int) -> None:
        assert response.status_code == status, response.text
        ids[response.headers["x-request-id"]] = (name, status)

    item = {"plaintext": b64(PLAINTEXT), "aad": b64(AAD)}
    encrypted = call(server, "POST", "/v1/encrypt/aes256-gcm", item)
    sent("encrypt", encrypted, 200)
    token = encrypted.json()["ciphertext"]
    sent("decrypt", call(server, "POST", "/v1/decrypt/aes256-gcm",
                         {"ciphertext": token, "aad": b64(AAD)}), 200)  # fmt: skip
    sent("decrypt", call(server, "POST", "/v1/decrypt/aes256-gcm", {"ciphertext": token}), 400)
    signature = call(server, "POST", "/v1/sign/ed25519", {"message": b64("m")})
    sent("sign", signature, 200)
    verify = {"message": b64("m"), "signature": signature.json()["signature"]}
    sent("verify", call(server, "POST", "/v1/verify/ed25519", verify), 200)
    sent("batch", call(server, "POST", "/v1/encrypt/aes256-gcm", {"batch": [item, item]}), 200)
    sent("create", call(server, "POST", "/v1/keys/audit-made", {"type": "aes256-gcm"}), 201)
    sent("rotate", call(server, "POST", "/v1/keys/audit-made/rotate"), 200)
    sent("describe", call(server, "GET", "/v1/keys/audit-made"), 200)
    sent("list", call(server, "GET", "/v1/keys"), 200)
    sent("unsigned", call(server, "POST", "/v1/encrypt/aes256-gcm", item, sign=False), 401)
    sent("missing", call(server, "POST", "/v1/encrypt/no-such-key", item), 404)
    time.sleep(0.8)  # a checkpoint after the last record

    records = audit_records(logs)
    counts = Counter(r.get("request_id") for r in records)
    for request_id in ids:
        assert counts[request_id] == 1, (request_id, ids[request_id])
    by_id = {r["request_id"]: r for r in records if r.get("request_id") in ids}
    events = {ids[i][0]: (r["event"], r["outcome"], r["status"]) for i, r in by_id.items()}
    assert events["encrypt"] == ("encrypt", "ok", 200)
    assert events["verify"] == ("verify", "ok", 200)
    assert events["decrypt"] in {("decrypt", "ok", 200), ("decrypt", "decryption_failed", 400)}
    assert events["create"] == ("key.create", "ok", 201)
    assert events["rotate"] == ("key.rotate", "ok", 200)
    assert events["unsigned"] == ("encrypt", "unauthenticated", 401)
    unsigned = next(r for i, r in by_id.items() if ids[i][0] == "unsigned")
    assert unsigned["client"] is None
    assert unsigned["key"] == "aes256-gcm"
    assert events["missing"][1:] == ("key_not_found", 404)
    encrypt = next(r for i, r in by_id.items() if ids[i][0] == "encrypt")
    assert encrypt["client"] == server.client_id
    assert encrypt["key_version"] == 1
    assert encrypt["aad"][0].startswith("hmac-sha256:")
    batch = next(r for i, r in by_id.items() if ids[i][0] == "batch")
    assert batch["items"] == 2
    assert len(batch["aad"]) == 1
    text = "".join(Path(f).read_text() for f in audit_files(logs))
    for secret in (PLAINTEXT, AAD, b64(PLAINTEXT), b64(AAD), token):
        assert secret not in text
    # The auditor finds the AAD by its HMAC, computed by the CLI from the deployment's salt.
    dev = server.directory / "dev"
    hashed = subprocess.run(
        [sys.executable, "-m", "service", "audit", "hash", AAD,
         "--keyring", str(dev / "keyring.json"), "--master-key-file", str(dev / "master.key")],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()  # fmt: skip
    assert hashed == encrypt["aad"][0]
    result = cli_verify(server, audit_files(logs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "audit trail verified" in result.stdout


def wait_ready(server: Server, ready: bool) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        answer = httpx.get(server.url + "/readyz", timeout=5)
        if (answer.status_code == 200) == ready:
            body: dict[str, Any] = answer.json()
            return body
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.1)


@pytest.mark.parametrize("breakage", ["read-only file", "deleted directory"])
def test_unwritable_audit_refuses_reports_and_recovers(
    audited: tuple[Server, Path], breakage: str
) -> None:
    server, logs = audited
    item = {"plaintext": b64(PLAINTEXT)}
    assert call(server, "POST", "/v1/encrypt/aes256-gcm", item).status_code == 200
    active = logs / "audit.log"
    kept = logs.parent / f"kept-{breakage.replace(' ', '-')}"
    if breakage == "read-only file":
        active.chmod(0o400)
    else:
        shutil.copytree(logs, kept)
        shutil.rmtree(logs)
    try:
        refused = call(server, "POST", "/v1/encrypt/aes256-gcm", item)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "audit_unavailable"
        assert refused.headers["retry-after"]
        assert call(server, "GET", "/v1/keys").status_code == 503  # every /v1/ request
        body = wait_ready(server, ready=False)
        assert body["checks"]["audit"]["ok"] is False
        assert any(reason.startswith("audit:") for reason in body["reasons"])
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert "cryptd_audit_write_failures_total" in metrics
    finally:
        if breakage == "read-only file":
            active.chmod(0o600)
        else:
            logs.mkdir()
    recovered = call(server, "POST", "/v1/encrypt/aes256-gcm", item)
    assert recovered.status_code == 200
    wait_ready(server, ready=True)
    refused_id = refused.headers["x-request-id"]
    assert refused_id not in {r.get("request_id") for r in audit_records(logs)}
    if breakage == "deleted directory":  # the saved files and the new one chain together
        files = audit_files(kept) + audit_files(logs)
        assert orjson.loads(Path(audit_files(logs)[0]).read_bytes().splitlines()[0])["seq"] > 1
        shutil.rmtree(kept)
        assert files


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (server workers, their pool processes)."""
    found = [pid]
    for child in children(pid):
        found += descendants(child)
    return found


def test_sigkill_under_mixed_load_loses_no_answered_record(tmp_path: Path) -> None:
    logs = tmp_path / "audit"
    logs.mkdir()
    server = start_server(
        tmp_path,
        {
            "CRYPTD_AUDIT_LOG": str(logs / "audit.log"),
            "CRYPTD_AUDIT_FAIL_CLOSED": "true",
            "CRYPTD_AUDIT_CHECKPOINT_INTERVAL": "0.5",
        },
        workers=2,
    )
    token = call(server, "POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64("x")}).json()
    requests = [
        ("POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64("load")}),
        ("POST", "/v1/decrypt/aes256-gcm", {"ciphertext": token["ciphertext"]}),
        ("POST", "/v1/sign/ed25519", {"message": b64("load")}),
        ("POST", "/v1/hmac/hmac-sha256", {"message": b64("load")}),
        ("GET", "/v1/keys/aes256-gcm", None),
    ]
    answered: list[str] = []
    stop = threading.Event()

    def load(offset: int) -> None:
        n = offset
        while not stop.is_set():
            method, path, body = requests[n % len(requests)]
            n += 1
            try:
                response = call(server, method, path, body)
            except httpx.HTTPError:
                continue
            if 200 <= response.status_code < 300:
                answered.append(response.headers["x-request-id"])

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20  # a busy machine answers slowly: enough answers first
    while len(answered) < 60 and time.monotonic() < deadline:
        time.sleep(0.1)
    victims = descendants(server.process.pid)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    stop.set()
    for thread in threads:
        thread.join()
    server.process.wait()
    assert len(answered) >= 20
    records = audit_records(logs)
    counts = Counter(r.get("request_id") for r in records)
    missing = [i for i in answered if counts[i] != 1]
    assert not missing, f"{len(missing)} of {len(answered)} answered requests not recorded once"
    streams = {r["stream"] for r in records if r.get("event") == "audit.open"}
    assert streams == {"w0", "w1"}
    result = cli_verify(server, audit_files(logs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 checkpoint" not in result.stdout


def test_a_full_disk_refuses_reports_and_recovers(tmp_path: Path) -> None:
    """The audit file on its own 1 MiB tmpfs (a private mount namespace), filled up."""
    needs_root("mounting a tmpfs in a private mount namespace")
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    prefix = [
        needs_tool("unshare"), "--mount", "--propagation", "private", "/bin/sh", "-c",
        'mount -t tmpfs -o size=1m,mode=0700 tmpfs "$0" && exec "$@"', str(mount_point),
    ]  # fmt: skip
    server = start_server(
        tmp_path,
        {"CRYPTD_AUDIT_LOG": str(mount_point / "audit.log"), "CRYPTD_AUDIT_FAIL_CLOSED": "true"},
        prefix=prefix,
    )
    try:
        seen = Path(f"/proc/{server.process.pid}/root") / mount_point.relative_to("/")
        item = {"plaintext": b64(PLAINTEXT)}
        assert call(server, "POST", "/v1/encrypt/aes256-gcm", item).status_code == 200
        filler = fill(seen)
        answered = []  # what still fits in the file's last page is written, and answered
        for _ in range(100):
            refused = call(server, "POST", "/v1/encrypt/aes256-gcm", item)
            if refused.status_code != 200:
                break
            answered.append(refused.headers["x-request-id"])
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "audit_unavailable"
        body = wait_ready(server, ready=False)
        assert any("No space left" in reason for reason in body["reasons"])
        filler.unlink()
        recovered = call(server, "POST", "/v1/encrypt/aes256-gcm", item)
        assert recovered.status_code == 200
        wait_ready(server, ready=True)
        records = audit_records(seen)
        ids = {r.get("request_id") for r in records}
        assert recovered.headers["x-request-id"] in ids
        assert ids.issuperset(answered)
        assert refused.headers["x-request-id"] not in ids
        result = cli_verify(server, audit_files(seen))  # no torn line left by the full disk
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        stop_server(server)


def test_sighup_rotates_and_the_chain_holds(audited: tuple[Server, Path]) -> None:
    server, logs = audited
    before = len(audit_files(logs))
    assert (
        call(server, "POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64("x")}).status_code == 200
    )
    os.kill(server.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while len(audit_files(logs)) == before:
        assert time.monotonic() < deadline, "no rotated file"
        time.sleep(0.1)
    answer = call(server, "POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64("y")})
    assert answer.status_code == 200
    rotated = [name for name in audit_files(logs) if name[-12:].isdigit()]
    assert rotated
    result = cli_verify(server, audit_files(logs), "--partial")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_request_leaves_the_group_commit_waiting(tmp_path: Path) -> None:
    """Every request counted as running (so that records wait for it to share a sync) stops
    being counted when it ends, whatever way it ends: with a group delay of a second, each
    answer after a mix of refused, malformed, oversized and abandoned requests still comes at
    once (a request left counted would hold every later record for the full second)."""
    logs = tmp_path / "audit"
    logs.mkdir()
    env = {
        "CRYPTD_AUDIT_LOG": str(logs / "audit.log"),
        "CRYPTD_AUDIT_FAIL_CLOSED": "true",
        "CRYPTD_AUDIT_GROUP_DELAY_MS": "1000",
        "CRYPTD_MAX_BODY_BYTES": "4096",
    }
    server = start_server(tmp_path, env)
    try:
        item = {"plaintext": b64(PLAINTEXT)}
        assert call(server, "POST", "/v1/encrypt/aes256-gcm", item).status_code == 200
        assert call(server, "POST", "/v1/encrypt/aes256-gcm", item, sign=False).status_code == 401
        assert call(server, "POST", "/v1/encrypt/no-such-key", item).status_code == 404
        assert call(server, "POST", "/v1/encrypt/aes256-gcm", raw=b"{").status_code == 400
        big = {"plaintext": b64("x" * 8192)}
        assert call(server, "POST", "/v1/encrypt/aes256-gcm", big).status_code == 413
        assert call(server, "GET", "/v1/keys/aes256-gcm").status_code == 200
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(3):  # clients that leave in the middle of their body
            with socket.create_connection((host, int(port)), timeout=5) as gone:
                gone.sendall(
                    b"POST /v1/encrypt/aes256-gcm HTTP/1.1\r\nhost: x\r\n"
                    b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"plain'
                )
        time.sleep(0.3)
        took = []
        for _ in range(10):
            started = time.monotonic()
            assert call(server, "POST", "/v1/encrypt/aes256-gcm", item).status_code == 200
            took.append(time.monotonic() - started)
        # A request left counted makes every answer wait the second; a busy machine, a few.
        assert sorted(took)[5] < 0.5, took
    finally:
        stop_server(server)


def sync_processes(pid: int) -> list[int]:
    """The audit sync processes below ``pid`` (service/audit/barrier.py)."""
    found = []
    for child in descendants(pid):
        with contextlib.suppress(FileNotFoundError):
            if b"barrier.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def test_a_killed_sync_process_loses_no_answered_record(tmp_path: Path) -> None:
    """The worker's sync process SIGKILLed under load: a new one takes over; every 2xx
    answered has its record, and the service keeps answering."""
    logs = tmp_path / "audit"
    logs.mkdir()
    server = start_server(
        tmp_path, {"CRYPTD_AUDIT_LOG": str(logs / "audit.log"), "CRYPTD_AUDIT_FAIL_CLOSED": "true"}
    )
    answered: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                response = call(server, "POST", "/v1/encrypt/aes256-gcm", {"plaintext": b64("x")})
            except httpx.HTTPError:
                continue
            if 200 <= response.status_code < 300:
                answered.append(response.headers["x-request-id"])

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while len(killed) < 3:
            assert time.monotonic() < deadline, f"sync processes seen: {killed}"
            for pid in sync_processes(server.process.pid):
                if pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.2)
        count = len(answered)
        deadline = time.monotonic() + 20
        while len(answered) < count + 20:  # answers go on after the last kill
            assert time.monotonic() < deadline, "no answer after the sync process was killed"
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        stop_server(server)
    records = audit_records(logs)
    counts = Counter(r.get("request_id") for r in records)
    missing = [i for i in answered if counts[i] != 1]
    assert not missing, f"{len(missing)} of {len(answered)} answered requests not recorded once"
    result = cli_verify(server, audit_files(logs))
    assert result.returncode == 0, result.stdout + result.stderr
