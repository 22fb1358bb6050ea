"""The audit trail's file: group commit, the hash chain, checkpoints, rotation, failures, and
``verify`` catching every kind of tampering."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from service.audit import chain, redact
from service.audit.verify import verify
from service.audit.writer import AuditWriter
from service.logs.audit import Audit, RequestRecord

SIGNING = Ed25519PrivateKey.generate()
KEYS: dict[int, Ed25519PublicKey] = {1: SIGNING.public_key()}


def sign(payload: bytes) -> tuple[int, bytes]:
    return 1, SIGNING.sign(payload)


def record(n: int, **extra: Any) -> RequestRecord:
    return RequestRecord(
        1_700_000_000.0 + n, "encrypt", "ok", 200, "billing", "payments", 3, 1, f"req-{n}",
        **extra,
    )  # fmt: skip


def open_audit(path: Path, **options: Any) -> Audit:
    audit = Audit(None, fail_closed=True, mac=redact.salted(b"s" * 32))
    options.setdefault("checkpoint_every", 5)
    audit.trail = AuditWriter(str(path), format=audit.body, signer=sign, **options)
    audit.enabled = audit.fail_closed = True
    return audit


async def commit_all(audit: Audit, first: int, count: int) -> list[bool]:
    return list(await asyncio.gather(*(audit.commit(record(first + n)) for n in range(count))))


@pytest.fixture
def trail(tmp_path: Path) -> Iterator[tuple[Path, Audit]]:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    yield path, audit
    audit.close()


def records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def drop_last_line(path: Path) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines_of(path)[:-1]))


def trail_files(path: Path) -> list[str]:
    return sorted(str(p) for p in path.parent.iterdir() if p.name.startswith(path.name))


async def test_records_are_durable_chained_and_checkpointed(trail: tuple[Path, Audit]) -> None:
    path, audit = trail
    assert await commit_all(audit, 0, 12) == [True] * 12
    lines = path.read_bytes().splitlines()
    found = [orjson.loads(line) for line in lines]
    assert found[0]["event"] == "audit.open"
    assert found[0]["seq"] == 1
    assert found[0]["prev"] == chain.GENESIS
    for before, line, after in zip(lines, found, found[1:], strict=False):
        assert after["seq"] == line["seq"] + 1
        assert after["prev"] == chain.line_hash(before)
    ids = [r["request_id"] for r in found if r["event"] == "encrypt"]
    assert sorted(ids) == sorted(f"req-{n}" for n in range(12))
    assert any(r["event"] == "audit.checkpoint" for r in found)
    assert verify([str(path)], KEYS).ok


async def test_many_waiting_records_share_one_sync(tmp_path: Path) -> None:
    """Group commit: 500 concurrent records take far fewer syncs than records."""
    path = tmp_path / "audit.log"
    audit = open_audit(path, checkpoint_every=10_000)
    assert audit.trail is not None
    before = audit.trail.syncs
    try:
        assert all(await commit_all(audit, 0, 500))
        syncs = audit.trail.syncs - before
    finally:
        audit.close()
    assert len([r for r in records(path) if r["event"] == "encrypt"]) == 500
    assert 1 <= syncs < 100, syncs


def syncs_of(audit: Audit) -> int:
    assert audit.trail is not None
    return audit.trail.syncs


async def test_a_record_waits_for_the_running_requests_to_share_its_sync(tmp_path: Path) -> None:
    """Group commit across requests that end at different moments: the first record waits for
    the requests still running (up to the group delay) and all three share one sync."""
    audit = open_audit(tmp_path / "audit.log", checkpoint_every=10_000, group_delay=5.0)
    before = syncs_of(audit)
    try:
        for _ in range(3):
            audit.begin()
        first = asyncio.ensure_future(audit.commit(record(1), begun=True))
        await asyncio.sleep(0.2)
        assert not first.done(), "synced while two requests were still running"
        second = asyncio.ensure_future(audit.commit(record(2), begun=True))
        await asyncio.sleep(0.1)
        assert not first.done()
        assert not second.done()
        assert await audit.commit(record(3), begun=True)
        assert await first
        assert await second
        assert syncs_of(audit) - before == 1
    finally:
        audit.close()
    found = [r["request_id"] for r in records(tmp_path / "audit.log") if r["event"] == "encrypt"]
    assert found == ["req-1", "req-2", "req-3"]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_writer_thread_does_not_preempt_the_event_loop(tmp_path: Path) -> None:
    audit = open_audit(tmp_path / "audit.log")
    try:
        assert audit.trail is not None
        assert audit.trail.flush()  # the thread has run
        thread = audit.trail._thread
        assert thread.native_id is not None
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is untouched
    finally:
        audit.close()


async def test_a_request_that_leaves_without_a_record_holds_nobody_up(tmp_path: Path) -> None:
    audit = open_audit(tmp_path / "audit.log", checkpoint_every=10_000, group_delay=5.0)
    before = syncs_of(audit)
    try:
        audit.begin()
        audit.begin()
        waiting = asyncio.ensure_future(audit.commit(record(1), begun=True))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        started = time.monotonic()
        audit.end()  # its client went away before an answer was possible
        assert await asyncio.wait_for(waiting, 2)
        assert time.monotonic() - started < 1
        assert syncs_of(audit) - before == 1
    finally:
        audit.close()


async def test_the_group_delay_bounds_the_wait_for_a_request_that_never_ends(
    tmp_path: Path,
) -> None:
    audit = open_audit(tmp_path / "audit.log", checkpoint_every=10_000, group_delay=0.05)
    try:
        audit.begin()
        audit.begin()  # still running when the test ends (a slow request)
        started = time.monotonic()
        assert await audit.commit(record(1), begun=True)
        waited = time.monotonic() - started
        assert 0.04 < waited < 1.0, waited
    finally:
        audit.close()


async def test_sensitive_values_are_hmacs_an_auditor_can_match(tmp_path: Path) -> None:
    from service.operations import EncryptItem

    path = tmp_path / "audit.log"
    audit = open_audit(path)
    item = EncryptItem(plaintext=b"PLAINTEXT-91c", aad=b"invoice-77", context=b"tenant-4")
    try:
        assert await audit.commit(record(1, values=(item, item)))
    finally:
        audit.close()
    data = path.read_bytes()
    assert b"PLAINTEXT-91c" not in data
    assert b"invoice-77" not in data
    assert b"tenant-4" not in data
    line = next(r for r in records(path) if r["event"] == "encrypt")
    mac = redact.salted(b"s" * 32)
    assert line["aad"] == [redact.hashed(mac, b"invoice-77")]  # once, though sent twice
    assert line["context"] == [redact.hashed(mac, "tenant-4")]
    assert line["aad"][0].startswith("hmac-sha256:")
    assert (line["client"], line["key"], line["key_version"]) == ("billing", "payments", 3)


@pytest.mark.parametrize("hash_key_names", [False, True])
def test_a_serialized_record_is_its_fields_whatever_the_shape(hash_key_names: bool) -> None:
    """body() (the writer's format: a plain request's repeated middle serialized once) writes
    exactly orjson.dumps(fields()), for plain records, records with a target key, a route,
    detail, HMAC'd values, a version list, and again once that middle is cached."""
    from service.operations import EncryptItem

    audit = Audit(None, mac=redact.salted(b"k" * 32), hash_key_names=hash_key_names)
    shapes = [
        record(1),
        record(2, values=(EncryptItem(plaintext=b"p"),)),  # values, none sensitive
        record(3, values=(EncryptItem(plaintext=b"p", aad=b"a"),)),
        record(4)._replace(key_version=(1, 2), items=2),
        record(5, target_key="other"),
        record(6, detail={"state": "disabled", "event": "not this"}),
        record(7, method="POST", path="/v1/x")._replace(status=401, outcome="unauthenticated"),
        record(8)._replace(request_id='quote " and \\ backslash', client=None, key=None),
        record(9)._replace(key_version=[1, 2]),  # type: ignore[arg-type]  # unhashable: slow path
    ]
    for shape in shapes * 2:
        assert audit.body(shape) == orjson.dumps(audit.fields(shape)), shape


def test_key_names_are_hashed_when_configured() -> None:
    mac = redact.salted(b"k" * 32)
    audit = Audit(None, mac=mac, hash_key_names=True)
    line = audit.fields(record(1))
    assert line["key"] == redact.hashed(mac, "payments")
    assert line["client"] == "billing"
    assert line["request_id"] == "req-1"


# -- tampering ---------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path: Path) -> Path:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    asyncio.run(commit_all(audit, 0, 20))
    audit.close()
    assert verify([str(path)], KEYS).ok
    return path


def rewrite(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def test_an_edited_byte_is_named(written: Path) -> None:
    lines = written.read_bytes().splitlines()
    lines[6] = lines[6].replace(b"req-", b"reQ-", 1)
    rewrite(written, lines)
    report = verify([str(written)], KEYS)
    assert not report.ok
    assert f"{written}:8 (seq 8)" in str(report.error)  # the line after the edit breaks


def test_a_deleted_line_is_named(written: Path) -> None:
    lines = written.read_bytes().splitlines()
    del lines[4]
    rewrite(written, lines)
    report = verify([str(written)], KEYS)
    assert not report.ok
    assert f"{written}:5 (seq 6)" in str(report.error)


def test_two_swapped_lines_are_named(written: Path) -> None:
    lines = written.read_bytes().splitlines()
    lines[3], lines[4] = lines[4], lines[3]
    rewrite(written, lines)
    report = verify([str(written)], KEYS)
    assert not report.ok
    assert f"{written}:4" in str(report.error)


def test_a_truncated_file_is_named(written: Path) -> None:
    data = written.read_bytes()
    written.write_bytes(data[: len(data) - 7])
    report = verify([str(written)], KEYS)
    assert not report.ok
    assert "truncated" in str(report.error)


def test_a_forged_checkpoint_is_refused(written: Path) -> None:
    """Whoever rewrites the file and re-chains it cannot sign: the keyring's key is needed."""
    other = {1: Ed25519PrivateKey.generate().public_key()}
    report = verify([str(written)], other)
    assert not report.ok
    assert "signature does not verify" in str(report.error)


def test_a_rechained_edit_still_fails_at_the_checkpoint(written: Path) -> None:
    lines = written.read_bytes().splitlines()
    found = [orjson.loads(line) for line in lines]
    found[2]["outcome"] = "forbidden"
    head = chain.Head(found[1]["seq"], chain.line_hash(lines[1]))
    for index in range(2, len(found)):  # recompute every later prev, as a forger would
        fields = {k: v for k, v in found[index].items() if k not in ("seq", "prev")}
        line, head = chain.encode(head, fields)
        lines[index] = line.rstrip(b"\n")
    rewrite(written, lines)
    report = verify([str(written)], KEYS)
    assert not report.ok
    assert "checkpoint" in str(report.error)


# -- rotation, restarts, workers ---------------------------------------------------------


async def test_rotation_keeps_the_chain_across_files(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path, max_bytes=2_000)
    try:
        for start in range(0, 40, 4):
            assert all(await commit_all(audit, start, 4))
        audit.rotate()
        assert all(await commit_all(audit, 100, 3))
    finally:
        audit.close()
    files = [*trail_files(path)[1:], str(path)]  # oldest first, the active file last
    assert len(files) > 2
    report = verify(list(reversed(files)), KEYS, sealed=True)  # any order
    assert report.ok, report.error
    (stream,) = report.streams
    assert stream.records == 43 + len(files)  # the requests and one audit.open per file
    ids = [r["request_id"] for f in files for r in records(Path(f)) if r["event"] == "encrypt"]
    assert len(ids) == len(set(ids)) == 43
    # A rotated file cut at a line boundary: its closing checkpoint is missing.
    drop_last_line(Path(files[0]))
    report = verify(files, KEYS)
    assert not report.ok
    assert "must end with a checkpoint" in str(report.error)
    # A missing middle file breaks the sequence.
    assert "expected seq" in str(verify(files[1:2] + files[3:], KEYS, partial=True).error)


async def test_a_restart_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    for start in (0, 10):
        audit = open_audit(path)
        assert all(await commit_all(audit, start, 3))
        audit.close()
    report = verify([str(path)], KEYS, sealed=True)
    assert report.ok, report.error
    assert [r["event"] for r in records(path)].count("audit.open") == 2


async def test_each_worker_writes_its_own_stream(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    first = open_audit(path)
    second = AuditWriter(str(path), index=1, format=first.fields, signer=sign)
    try:
        assert await first.commit(record(1))
        assert await second.commit(record(2))
    finally:
        first.close()
        second.close()
    assert sorted(trail_files(path)) == [str(path), f"{path}.w1"]
    report = verify(trail_files(path), KEYS)
    assert report.ok
    assert [s.stream for s in report.streams] == ["w0", "w1"]


# -- failures: refused, reported, recovered without a restart ----------------------------


async def test_a_read_only_file_refuses_then_recovers(trail: tuple[Path, Audit]) -> None:
    path, audit = trail
    assert await audit.commit(record(1))
    path.chmod(0o400)
    assert await commit_all(audit, 2, 3) == [False] * 3
    assert not audit.healthy()
    assert "read-only" in str(audit.reason())
    assert audit.trail is not None
    assert audit.trail.failures == 3
    path.chmod(0o600)
    assert await audit.commit(record(9))
    assert audit.healthy()
    assert audit.reason() is None
    ids = [r["request_id"] for r in records(path) if r["event"] == "encrypt"]
    assert ids == ["req-1", "req-9"]  # nothing of the refused ones, nothing twice
    assert verify([str(path)], KEYS).ok


async def test_a_deleted_directory_refuses_then_recovers(tmp_path: Path) -> None:
    directory = tmp_path / "logs"
    directory.mkdir()
    path = directory / "audit.log"
    failures: list[int] = []
    audit = open_audit(path, on_failure=failures.append)
    try:
        assert await audit.commit(record(1))
        kept = (tmp_path / "kept.log").write_bytes(path.read_bytes())
        shutil.rmtree(directory)
        assert not await audit.commit(record(2))
        assert "No such file" in str(audit.reason())
        assert sum(failures) == 1
        directory.mkdir()
        assert await audit.commit(record(3))
        assert audit.healthy()
    finally:
        audit.close()
    assert kept
    new = records(path)
    assert new[0]["event"] == "audit.open"
    assert new[0]["seq"] > 1
    assert [r["request_id"] for r in new if r["event"] == "encrypt"] == ["req-3"]
    assert not verify([str(path)], KEYS).ok  # records before it are gone: not silently
    before = (tmp_path / "kept.log").read_bytes().splitlines()
    assert new[0]["prev"] == chain.line_hash(before[-1])


async def test_a_torn_tail_is_kept_aside_and_the_chain_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    assert all(await commit_all(audit, 0, 3))
    audit.close()
    with path.open("ab") as handle:
        handle.write(b'{"seq":99,"prev":"ab')  # a write cut short
    audit = open_audit(path)
    try:
        assert await audit.commit(record(7))
    finally:
        audit.close()
    torn = [f for f in trail_files(path) if ".torn-" in f]
    assert len(torn) == 1
    assert not verify([torn[0]], KEYS).ok
    assert records(path)[0]["prev"] == chain.line_hash(lines_of(Path(torn[0]))[-2])


async def test_recovery_is_seen_without_any_request(tmp_path: Path) -> None:
    """A pod that is not ready gets no traffic: the writer probes the file by itself."""
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    try:
        assert await audit.commit(record(1))
        path.chmod(0o400)
        assert not await audit.commit(record(2))
        path.chmod(0o600)
        deadline = time.monotonic() + 5
        while not audit.healthy():
            assert time.monotonic() < deadline, audit.reason()
            await asyncio.sleep(0.05)
    finally:
        audit.close()
    assert records(path)[-1]["event"] == "audit.checkpoint"
    assert verify([str(path)], KEYS, sealed=True).ok


def test_sm2_signer_ids_and_derivation_contexts_are_hmacs() -> None:
    from service.crypto.base import SignOptions
    from service.operations import HmacItem, SignItem

    mac = redact.salted(b"d" * 32)
    audit = Audit(None, mac=mac)
    signed = SignItem(data=b"MESSAGE-1", options=SignOptions(signer_id=b"alice@bank.example"))
    derived = HmacItem(data=b"MESSAGE-2", context=b"tenant-9")
    line = audit.fields(record(1, values=(signed, derived)))
    assert line["signer_id"] == [redact.hashed(mac, b"alice@bank.example")]
    assert line["context"] == [redact.hashed(mac, b"tenant-9")]
    assert "aad" not in line
    text = orjson.dumps(line)
    for secret in (b"MESSAGE-1", b"MESSAGE-2", b"alice@bank", b"tenant-9"):
        assert secret not in text


async def test_a_record_that_cannot_be_formatted_refuses_only_its_request(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    broken = record(2, detail={"bad": object()})  # orjson cannot write it
    try:
        results = list(
            await asyncio.gather(
                audit.commit(record(1)), audit.commit(broken), audit.commit(record(3))
            )
        )
    finally:
        audit.close()
    assert results == [True, False, True]
    ids = [r["request_id"] for r in records(path) if r["event"] == "encrypt"]
    assert ids == ["req-1", "req-3"]
