"""The audit file's sync process (service/audit/barrier.py): killed, missing, or outliving its
worker, a request is still answered 2xx only once its record is durable."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from service.audit.verify import verify
from tests.test_audit_trail import KEYS, commit_all, open_audit, record, records


def sync_pid(audit_trail: object) -> int:
    syncer = getattr(audit_trail, "_syncer", None)
    assert syncer is not None, "no sync process"
    pid: int = syncer.pid
    return pid


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_killed_sync_process_is_replaced_and_no_answer_lacks_its_record(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.log"
    audit = open_audit(path, checkpoint_every=50)
    trail = audit.trail
    assert trail is not None
    answered: list[str] = []
    try:
        assert all(await commit_all(audit, 0, 10))
        first = sync_pid(trail)

        stop = asyncio.Event()

        async def load(offset: int) -> None:
            n = offset
            while not stop.is_set():
                if await audit.commit(record(n)):
                    answered.append(f"req-{n}")
                n += 8

        tasks = [asyncio.ensure_future(load(1_000 + i)) for i in range(8)]
        try:
            for _ in range(3):  # killed while syncs are asked of it, three times over
                deadline = time.monotonic() + 5
                while trail._syncer is None or not trail._syncer.answered:
                    assert time.monotonic() < deadline, "no sync process started again"
                    await asyncio.sleep(0.01)
                os.kill(sync_pid(trail), signal.SIGKILL)
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert trail.sync_restarts >= 1
        assert sync_pid(trail) != first
        assert not alive(first)
        assert await audit.commit(record(10_000))  # still answered, the new process syncing
    finally:
        audit.close()
    counts = Counter(r.get("request_id") for r in records(path))
    assert answered, "nothing answered"
    missing = [i for i in answered if counts[i] != 1]
    assert not missing, f"{len(missing)} of {len(answered)} answered requests not recorded once"
    assert verify([str(path)], KEYS, sealed=True).ok


async def test_without_a_sync_process_the_loop_syncs_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No interpreter to start it with: records are still durable before the answer."""
    path = tmp_path / "audit.log"
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    audit = open_audit(path)
    trail = audit.trail
    assert trail is not None
    try:
        before = trail.syncs
        assert all(await commit_all(audit, 0, 20))
        assert trail._syncer is None
        assert trail.syncs > before
        assert trail.healthy()
    finally:
        audit.close()
    assert len([r for r in records(path) if r["event"] == "encrypt"]) == 20


def open_flags(pid: int, path: Path) -> list[int]:
    """The flags of each descriptor ``pid`` holds on ``path`` (its open file description's)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                found.append(int(info.split("flags:")[1].split()[0], 8))
    return found


def seen_by(pid: int) -> tuple[bytes, set[str]]:
    """The process's environment and the files it holds open (but stdin, stdout, stderr)."""
    environment = Path(f"/proc/{pid}/environ").read_bytes()
    fds = [fd for fd in os.listdir(f"/proc/{pid}/fd") if int(fd) > 2]
    held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
    return environment, {name for name in held if name.startswith("/")}


async def test_the_sync_process_holds_no_environment_and_only_the_audit_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYPTD_MASTER_KEY", "a-secret-that-stays-in-the-worker")
    path = tmp_path / "audit.log"
    audit = open_audit(path)
    trail = audit.trail
    assert trail is not None
    try:
        assert await audit.commit(record(1))
        pid = sync_pid(trail)
        environment, files = seen_by(pid)
        assert environment == b""
        assert str(path) in files
        assert files == {str(path)}  # and its socket
        # Its own open file description (read-only, where the writer's appends): a writeback
        # error is reported to each description, so neither side's sync can hide it.
        (theirs,) = open_flags(pid, path)
        assert theirs & os.O_ACCMODE == os.O_RDONLY
        assert any(ours & os.O_APPEND for ours in open_flags(os.getpid(), path))
    finally:
        audit.close()
    deadline = time.monotonic() + 5
    while alive(pid):  # closed with the writer
        assert time.monotonic() < deadline, "the sync process outlived its writer"
        await asyncio.sleep(0.05)


def test_the_sync_process_dies_with_its_worker(tmp_path: Path) -> None:
    """A worker killed outright (no close, no exit handler) takes its sync process along."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        from tests.test_audit_trail import open_audit, record
        async def main():
            audit = open_audit(__import__("pathlib").Path({str(tmp_path / "audit.log")!r}))
            assert await audit.commit(record(1))
            print(audit.trail._syncer.pid, flush=True)
            time.sleep(60)
        asyncio.run(main())
        """
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert worker.stdout is not None
        pid = int(worker.stdout.readline())
        assert alive(pid)
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 5
        while alive(pid):
            assert time.monotonic() < deadline, "the sync process outlived its worker"
            time.sleep(0.05)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()
