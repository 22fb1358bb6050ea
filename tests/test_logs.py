"""Structured JSON logs and the access log: shape, levels, non-blocking writes, whole lines."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from service.api.timing import timed
from service.asgi import ASGIApp, Receive, Scope, Send
from service.logs import LineWriter, LogSetup, configure_logging
from service.logs.fields import timestamp as _timestamp
from service.metrics import Metrics

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\Z")


@pytest.mark.parametrize(
    "now", [0.0, 0.0004, 1.999, 1764626400.0, 1764626400.0009, 1764626400.5, 1764626400.9999]
)
def test_timestamp_is_utc_to_the_millisecond_truncated(now: float) -> None:
    second = int(now)
    expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    expected += f".{int((now - second) * 1000):03d}Z"
    assert _timestamp(now) == expected
    assert TIMESTAMP.match(_timestamp(now))


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)


@pytest.fixture
def stderr_file(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "stderr.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    yield path, fd
    os.close(fd)


@pytest.fixture
def configured(stderr_file: tuple[Path, int]) -> Iterator[LogSetup]:
    setup = configure_logging("info", True, "off", stderr_fd=stderr_file[1])
    yield setup
    setup.close()


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_records_are_json_lines_with_scalar_extras_only(
    configured: LogSetup, stderr_file: tuple[Path, int]
) -> None:
    log = logging.getLogger("cryptd.test")
    log.info(
        "key %s rotated",
        "payments",
        extra={"request_id": "r-1", "key_version": 3, "raw": b"\x00key", "nested": {"a": 1}},
    )
    configured.flush()
    (line,) = [entry for entry in lines(stderr_file[0]) if entry["logger"] == "cryptd.test"]
    assert TIMESTAMP.match(line["ts"])
    assert line["level"] == "info"
    assert line["msg"] == "key payments rotated"
    assert line["request_id"] == "r-1"
    assert line["key_version"] == 3
    assert "raw" not in line
    assert "nested" not in line


def test_exceptions_log_their_type_and_frames_never_their_message(
    configured: LogSetup, stderr_file: tuple[Path, int]
) -> None:
    log = logging.getLogger("cryptd.test")
    try:
        raise ValueError("input was 'hunter2-plaintext'")
    except ValueError:
        log.exception("operation failed")
    configured.flush()
    text = stderr_file[0].read_text()
    assert "hunter2" not in text
    (line,) = lines(stderr_file[0])
    assert line["exc_type"] == "ValueError"
    assert line["level"] == "error"
    assert any("test_logs.py" in frame for frame in line["frames"])


def test_level_filters_and_hides_the_access_log(stderr_file: tuple[Path, int]) -> None:
    setup = configure_logging("warning", True, "off", stderr_fd=stderr_file[1])
    try:
        assert setup.access_log is None  # access lines are info lines
        log = logging.getLogger("cryptd.test")
        log.info("not shown")
        log.warning("shown")
        setup.flush()
    finally:
        setup.close()
    assert [line["msg"] for line in lines(stderr_file[0])] == ["shown"]
    quiet = configure_logging("debug", False, "off", stderr_fd=stderr_file[1])
    quiet.close()
    assert quiet.access_log is None
    with pytest.raises(ValueError, match="log level"):
        configure_logging("verbose", True, "off", stderr_fd=stderr_file[1])


@dataclass
class FakeClient:
    id: str


class SetsRequestState:
    """What the API does: request-scoped fields in scope["state"], read after the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {}).update(
                request_id="req-42", client=FakeClient("billing"), key="payments",
                operation="encrypt", key_version=7,
            )  # fmt: skip
        await self.app(scope, receive, send)


async def test_one_access_line_per_request_with_request_fields(
    configured: LogSetup, stderr_file: tuple[Path, int]
) -> None:
    app = FastAPI()

    @app.post("/v1/encrypt/{key}")
    async def encrypt(key: str) -> dict[str, str]:
        return {"key": key}

    app.add_middleware(SetsRequestState)
    wrapped = timed(Metrics(), app, access_log=configured.access_log)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=wrapped), base_url="http://test"
    ) as client:
        for _ in range(3):
            assert (await client.post("/v1/encrypt/payments")).status_code == 200
        assert (await client.get("/nowhere")).status_code == 404
    configured.flush()
    access = [line for line in lines(stderr_file[0]) if line["logger"] == "cryptd.access"]
    assert len(access) == 4
    first = access[0]
    assert first["request_id"] == "req-42"
    assert first["client"] == "billing"
    assert first["key"] == "payments"
    assert first["operation"] == "encrypt"
    assert first["key_version"] == 7
    assert first["method"] == "POST"
    assert first["route"] == "/v1/encrypt/{key}"
    assert first["status"] == 200
    assert first["latency_ms"] > 0
    assert access[3]["route"] == "unmatched"
    assert access[3]["status"] == 404


def test_lines_from_many_threads_arrive_whole_through_a_pipe() -> None:
    read_end, write_end = os.pipe()
    writer = LineWriter(write_end, owns_fd=True)
    received = bytearray()

    def read_all() -> None:
        while chunk := os.read(read_end, 65536):
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()

    def produce(thread: int) -> None:
        for index in range(500):
            line = {"thread": thread, "index": index, "pad": "x" * (index % 700)}
            writer.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))

    producers = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    for producer in producers:
        producer.start()
    for producer in producers:
        producer.join()
    writer.close()
    reader.join(timeout=30)
    os.close(read_end)
    parsed = [orjson.loads(line) for line in bytes(received).splitlines()]
    assert len(parsed) == 2000
    for thread in range(4):
        mine = [p["index"] for p in parsed if p["thread"] == thread]
        assert mine == list(range(500))  # whole and in order


def test_a_stuck_destination_drops_log_lines_instead_of_blocking() -> None:
    read_end, write_end = os.pipe()
    writer = LineWriter(write_end, max_pending=5, owns_fd=True)
    line = b"x" * 1023 + b"\n"
    accepted = [writer.write(line) for _ in range(300)]  # nobody reads: the pipe fills
    assert not all(accepted)
    assert writer.dropped == accepted.count(False) > 100
    received = bytearray()

    def read_all() -> None:
        while chunk := os.read(read_end, 65536):
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    writer.close()
    reader.join(timeout=30)
    os.close(read_end)
    body = bytes(received).splitlines()
    assert body.count(line[:-1]) == accepted.count(True)
    notice = orjson.loads(body[-1])
    assert notice["msg"] == "log lines dropped"
    assert notice["dropped_total"] == writer.dropped


def test_a_forked_child_writes_through_its_own_writer_thread(tmp_path: Path) -> None:
    path = tmp_path / "out.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    writer = LineWriter(fd, owns_fd=True)
    writer.write(b'{"from":"parent-before"}\n')
    writer.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        writer.write(b'{"from":"child"}\n')
        os._exit(0 if writer.flush(10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer.write(b'{"from":"parent-after"}\n')
    writer.close()
    sources = [orjson.loads(line)["from"] for line in path.read_bytes().splitlines()]
    assert sorted(sources) == ["child", "parent-after", "parent-before"]


def test_late_lines_after_close_are_written_at_once_or_counted(tmp_path: Path) -> None:
    path = tmp_path / "late.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        borrowed = LineWriter(fd)
        borrowed.close()
        assert borrowed.write(b'{"late":1}\n')
        assert path.read_bytes() == b'{"late":1}\n'
    finally:
        os.close(fd)
    owned = LineWriter(os.open(path, os.O_WRONLY | os.O_APPEND), owns_fd=True)
    owned.close()  # its descriptor is closed: the number may belong to another file now
    owned.write(b'{"later":2}\n')
    assert owned.dropped == 1
    assert path.read_bytes() == b'{"late":1}\n'


def test_access_log_reads_the_auth_layers_client_id(
    configured: LogSetup, stderr_file: tuple[Path, int]
) -> None:
    @dataclass
    class AuthClient:
        client_id: str

    assert configured.access_log is not None
    scope = {"type": "http", "method": "POST", "state": {"client": AuthClient("batch-jobs")}}
    configured.access_log(scope, "/v1/sign/{key}", 200, 0.0012)
    configured.flush()
    (line,) = lines(stderr_file[0])
    assert line["client"] == "batch-jobs"
    assert line["latency_ms"] == 1.2
    assert line["key"] is None


@pytest.mark.slow
def test_two_processes_sharing_a_pipe_never_interleave_inside_a_line() -> None:
    """Like several workers on the container's stderr: each writes batches far larger than
    PIPE_BUF, which the writer cuts at line boundaries into atomic pipe writes."""
    read_end, write_end = os.pipe()
    code = """
import os, sys
import orjson
from service.logs import LineWriter
fd, name = int(sys.argv[1]), sys.argv[2]
writer = LineWriter(fd)
for index in range(1500):
    pad = "x" * (1000 + index % 350 * 7)  # lines up to 3.5 KB, under PIPE_BUF
    writer.write(orjson.dumps({"from": name, "index": index, "pad": pad}) + b"\\n")
writer.close()
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(write_end), name], env=env, pass_fds=(write_end,)
        )
        for name in ("a", "b")
    ]
    os.close(write_end)
    received = bytearray()
    # A slow reader keeps the pipe full, so both writers block in write() at the same time:
    # the case where a write larger than PIPE_BUF would be split and interleaved.
    while chunk := os.read(read_end, 4096):
        received.extend(chunk)
        time.sleep(0.0002)
    os.close(read_end)
    for child in children:
        assert child.wait(timeout=60) == 0
    parsed = [orjson.loads(line) for line in bytes(received).splitlines()]
    for name in ("a", "b"):
        assert [p["index"] for p in parsed if p["from"] == name] == list(range(1500))


def _audit_dictionary(fields: tuple[Any, ...]) -> bytes:
    """An audit line as one dictionary serialized whole: what the writer must produce."""
    when, event, outcome, client, key, key_version, items, request_id, target_key, detail = fields
    second = int(when)
    line = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        + f".{int((when - second) * 1000):03d}Z",
        "level": "info",
        "logger": "cryptd.audit",
        "msg": "audit",
        "event": event,
        "outcome": outcome,
        "client": client,
        "key": key,
        "key_version": list(key_version) if isinstance(key_version, tuple) else key_version,
        "items": items,
        "request_id": request_id,
    }
    if target_key is not None:
        line["target_key"] = target_key
    if detail:
        line.update({name: value for name, value in detail.items() if name not in line})
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def test_audit_lines_are_the_dictionary_serialized_whole_byte_for_byte() -> None:
    from service.logs import audit as logs

    now = time.time()
    cases = [
        (now, "decrypt", "ok", "client-1", "aes", 1, 1, "0123abcd", None, None),
        (now + 0.9999, "sign", "partial", None, 'odd "name"\u2028', (1, 3), 2, None, None, None),
        (now, "decrypt", "key_not_found", "c", "missing", None, 1, "r", None, {}),
        (now, "rewrap", "ok", "c", "k", 2, 1, "r", "target", None),
        (now, "key.state", "ok", "c", "k", None, 1, "r", None, {"state": "disabled", "key": "x"}),
        (1.0 - 2**-60, "decrypt", "ok", "c", "k", 1, 1, "r", None, None),  # .1000Z, as before
    ]
    for fields in cases * 2:  # the second time from the serialized middles
        assert logs._format_audit(fields) == _audit_dictionary(fields), fields
    for n in range(logs._AUDIT_MIDDLES_MAX + 10):  # many keys: the middles stay bounded
        fields = (now, "decrypt", "ok", "c", f"key-{n}", n, 1, str(n), None, None)
        assert logs._format_audit(fields) == _audit_dictionary(fields)
    assert len(logs._audit_middles) <= logs._AUDIT_MIDDLES_MAX
