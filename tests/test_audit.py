"""The audit stream, and the rule that no log line ever holds a secret."""

from __future__ import annotations

import base64
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from service.api.timing import timed
from service.logs import Audit, LineWriter, LogSetup, configure_logging
from service.metrics import Metrics


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


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_audit_file_gets_who_what_which_version_when_and_outcome(
    tmp_path: Path, stderr_file: tuple[Path, int]
) -> None:
    target = tmp_path / "audit.log"
    target.write_text('{"earlier":"run"}\n')
    setup = configure_logging("info", False, str(target), stderr_fd=stderr_file[1])
    try:
        audit = setup.audit
        assert audit.enabled
        audit.record("decrypt", client="billing", key="payments", key_version=3, outcome="ok",
                     request_id="r-1")  # fmt: skip
        audit.record("sign", client="billing", key="invoices", key_version=[2, 1, 2],
                     outcome="partial", items=3)  # fmt: skip
        audit.record("key.rotate", client="ops", key="payments", key_version=4, outcome="ok")
        audit.record("rewrap", client="ops", key="legacy-rsa", key_version=1, outcome="ok",
                     target_key="new-sm2")  # fmt: skip
        audit.record("decrypt", client="intruder", key="payments", outcome="denied")
        setup.flush()
    finally:
        setup.close()
    found = lines(target)
    assert found[0] == {"earlier": "run"}  # appended, never truncated
    decrypt, sign, rotate, rewrap, denied = found[1:]
    assert decrypt["logger"] == "cryptd.audit"
    assert decrypt["ts"].endswith("Z")
    assert (decrypt["event"], decrypt["client"], decrypt["key"], decrypt["key_version"]) == (
        "decrypt", "billing", "payments", 3,
    )  # fmt: skip
    assert decrypt["outcome"] == "ok"
    assert decrypt["request_id"] == "r-1"
    assert sign["key_version"] == [1, 2]
    assert sign["items"] == 3
    assert rotate["event"] == "key.rotate"
    assert rewrap["target_key"] == "new-sm2"
    assert denied["outcome"] == "denied"
    assert denied["key_version"] is None
    assert stderr_file[0].read_bytes() == b""  # the audit file is the only destination


def test_a_new_audit_file_is_private(tmp_path: Path, stderr_file: tuple[Path, int]) -> None:
    target = tmp_path / "new-audit.log"
    configure_logging("info", False, str(target), stderr_fd=stderr_file[1]).close()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_audit_to_stderr_shares_the_log_stream(stderr_file: tuple[Path, int]) -> None:
    setup = configure_logging("info", False, "stderr", stderr_fd=stderr_file[1])
    try:
        setup.audit.record("sign", client="c", key="k", key_version=1, outcome="ok")
        logging.getLogger("cryptd.test").info("ordinary line")
        setup.flush()
    finally:
        setup.close()
    assert [line["logger"] for line in lines(stderr_file[0])] == ["cryptd.audit", "cryptd.test"]


def test_audit_off_writes_nothing(tmp_path: Path, stderr_file: tuple[Path, int]) -> None:
    setup = configure_logging("info", False, "off", stderr_fd=stderr_file[1])
    try:
        assert not setup.audit.enabled
        setup.audit.record("decrypt", client="c", key="k", key_version=1, outcome="ok")
        setup.flush()
    finally:
        setup.close()
    assert stderr_file[0].read_bytes() == b""
    assert list(tmp_path.iterdir()) == [stderr_file[0]]


def test_a_failing_audit_destination_makes_the_audit_unhealthy() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    audit = Audit(LineWriter(write_end, owns_fd=True))
    assert audit.healthy()
    audit.record("decrypt", client="c", key="k", key_version=1, outcome="ok")
    audit.flush()
    assert not audit.healthy()


# -- no secret in any log line ---------------------------------------------------------------

PLAINTEXT = "PLAINTEXT-c0ffee-7d1e"
KEY_MATERIAL = "KEYMATERIAL-51a9-e4b2"
CLIENT_SECRET = "CLIENTSECRET-90ab-77cd"
SIGNATURE = "SIGNATURE-3f3f-a0a0"
SECRETS = (PLAINTEXT, KEY_MATERIAL, CLIENT_SECRET, SIGNATURE)


def forms(secret: str) -> list[str]:
    """The secret as it may travel: raw, base64 and base64url of its bytes."""
    raw = secret.encode()
    return [secret, base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()]


class EncryptBody(BaseModel):
    plaintext: str
    key_version: int | None = None


def secret_app(setup: LogSetup) -> FastAPI:
    app = FastAPI()
    log = logging.getLogger("cryptd.test.api")

    @app.post("/v1/encrypt/{key}")
    async def encrypt(key: str, body: EncryptBody, request: Request) -> dict[str, str]:
        request.scope.setdefault("state", {}).update(key=key, operation="encrypt", key_version=1)
        log.info("encrypting", extra={"key": key, "plaintext": body.plaintext.encode()})
        return {"ciphertext": "cryptd:v1:AAAA"}

    @app.post("/v1/decrypt/{key}")
    async def decrypt(key: str, request: Request) -> dict[str, str]:
        document = orjson.loads(await request.body())
        try:
            raise ValueError(f"bad padding near {document['ciphertext']} with {KEY_MATERIAL}")
        except ValueError:
            log.exception("decrypt failed", extra={"key": key})
        setup.audit.record("decrypt", client="billing", key=key, key_version=1, outcome="error")
        return {"error": "decryption_failed"}

    @app.post("/v1/sign/{key}")
    async def sign(key: str) -> dict[str, str]:
        setup.audit.record("sign", client="billing", key=key, key_version=2, outcome="ok")
        return {"signature": base64.b64encode(SIGNATURE.encode()).decode()}

    return app


async def test_known_secrets_pushed_through_requests_reach_no_log_line(
    tmp_path: Path, stderr_file: tuple[Path, int]
) -> None:
    audit_path = tmp_path / "audit.log"
    setup = configure_logging("debug", True, str(audit_path), stderr_fd=stderr_file[1])
    try:
        wrapped = timed(Metrics(), secret_app(setup), access_log=setup.access_log)
        headers = {
            "Signature": f"sig1=:{base64.b64encode(SIGNATURE.encode()).decode()}:",
            "Authorization": f"Bearer {CLIENT_SECRET}",
            "X-Client-Secret": CLIENT_SECRET,
        }
        transport = httpx.ASGITransport(app=wrapped)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ok = await client.post("/v1/encrypt/payments", json={"plaintext": PLAINTEXT},
                                   headers=headers, params={"token": CLIENT_SECRET})  # fmt: skip
            assert ok.status_code == 200
            # A validation error: FastAPI's message repeats the refused input.
            bad = await client.post("/v1/encrypt/payments", json={"plaintext": PLAINTEXT,
                                    "key_version": f"{KEY_MATERIAL}"}, headers=headers)  # fmt: skip
            assert bad.status_code == 422
            await client.post("/v1/decrypt/payments", json={"ciphertext": PLAINTEXT},
                              headers=headers)  # fmt: skip
            signed = await client.post("/v1/sign/payments", json={"message": PLAINTEXT})
            assert SIGNATURE.encode() in base64.b64decode(signed.json()["signature"])
        setup.flush()
    finally:
        setup.close()

    everything = stderr_file[0].read_text() + audit_path.read_text()
    logged = lines(stderr_file[0]) + lines(audit_path)
    assert sum(line["logger"] == "cryptd.access" for line in logged) == 4
    assert sum(line["logger"] == "cryptd.audit" for line in logged) == 2
    assert any(line.get("exc_type") == "ValueError" for line in logged)
    for secret in SECRETS:
        for form in forms(secret):
            assert form not in everything, secret
