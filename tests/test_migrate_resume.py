"""Resuming ``cryptd migrate``: real SIGKILLs, Ctrl-C, crashes on either side of a commit, and
rows changed by someone else while the migration runs. After any of them every row is
migrated exactly once: the totals count each row once and no row was re-done (a re-done row
would show up as skipped, already under the target key)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from cryptd_client import CryptdClient
from service.migrate.checkpoint import CheckpointFile
from service.migrate.failures import FailureLog
from service.migrate.model import Page
from service.migrate.rewrapping import Migration, Options
from service.migrate.service import Rewrapper, preflight
from service.migrate.source import Changes, Written
from service.migrate.sql import SqlSource
from tests.conftest import Server
from tests.migrate_support import (
    Table,
    client,
    decrypts_to,
    encrypt,
    migrate_command,
    new_key,
    run_migrate,
    sql_args,
    table_of,
)
from tests.tcp_relay import pipe

pytestmark = pytest.mark.slow  # a live server, the migration tool interrupted and resumed


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tokens.db'}"
    url: str = request.getfixturevalue("pg_database")
    return url


@pytest.fixture
def cryptd(server: Server) -> Iterator[CryptdClient]:
    with client(server) as c:
        yield c


def _committed(checkpoint: Path) -> int:
    try:
        data = json.loads(checkpoint.read_text())
    except (FileNotFoundError, ValueError):
        return 0
    counts = data["committed"]["counts"]
    skipped: dict[str, int] = counts["skipped"]
    return int(counts["migrated"]) + sum(skipped.values())


def _wait_for_progress(checkpoint: Path, beyond: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while _committed(checkpoint) <= beyond:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)


def _assert_exactly_once(report: dict[str, Any], rows: int) -> None:
    total = report["total"]
    assert total["migrated"] == rows
    assert total["skipped"] == {}  # nothing committed was done twice
    assert total["failed"] == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pair", "rows"), [(("aes256-gcm", "sm4-gcm"), 30000), (("rsa-2048", "sm2"), 2500)]
)
def test_sigkilled_three_times_then_resumed(
    server: Server,
    cryptd: CryptdClient,
    db_url: str,
    tmp_path: Path,
    pair: tuple[str, str],
    rows: int,
) -> None:
    source, target = new_key(cryptd, pair[0]), new_key(cryptd, pair[1])
    table = table_of(cryptd, db_url, source, rows)
    checkpoint = tmp_path / "kill.ckpt"
    batch = "100" if rows > 5000 else "25"
    args = sql_args(table, source, target, "--checkpoint", str(checkpoint), "--batch-size", batch)
    kills = 0
    seen = 0
    while kills < 3:
        with subprocess.Popen(
            migrate_command(server, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        ) as process:
            # The k-th kill waits for a k-th fifth of the table, so the three kills land early,
            # in the middle and late while most of the table is still to do (a group commit can
            # take thousands of rows at once on a fast machine).
            _wait_for_progress(checkpoint, max(seen, rows * kills // 5), process)
            time.sleep(random.uniform(0, 0.1))  # anywhere: reading, at the service, committing
            process.send_signal(signal.SIGKILL)
            assert process.wait(timeout=30) == -signal.SIGKILL
        kills += 1
        seen = _committed(checkpoint)
        assert seen < rows, "the run finished before it could be killed: make the table bigger"
    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    assert report["resumed"] is True
    _assert_exactly_once(report, rows)
    assert all(decrypts_to(cryptd, target, table.rows()))


def test_ctrl_c_stops_cleanly_and_the_run_resumes(
    server: Server, cryptd: CryptdClient, tmp_path: Path
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 12000)
    checkpoint = tmp_path / "int.ckpt"
    args = sql_args(table, source, target, "--checkpoint", str(checkpoint), "--batch-size", "50")
    process = subprocess.Popen(
        [*migrate_command(server, *args), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _wait_for_progress(checkpoint, 0, process)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    report = json.loads(out)
    assert report["signal"] == "SIGINT"
    assert report["status"] == "interrupted"
    saved = json.loads(checkpoint.read_text())
    assert saved["done"] is False
    assert saved["pending"] is None  # a clean checkpoint: every page in flight was committed
    assert saved["committed"]["counts"]["migrated"] == report["total"]["migrated"] > 0
    done = report["total"]["migrated"]
    assert sum(decrypts_to(cryptd, target, table.rows())) == done

    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    _assert_exactly_once(report, 12000)
    assert report["run"]["migrated"] == 12000 - done


@pytest.mark.parametrize("changed", ["source", "target"])
def test_a_key_disabled_during_the_run_stops_it_and_the_run_resumes(
    server: Server, cryptd: CryptdClient, tmp_path: Path, changed: str
) -> None:
    """docs/MIGRATION.md, exit status 3: a key made unusable mid-run stops the run with the
    checkpoint consistent; the same command completes once the key is enabled again."""
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 6000)
    checkpoint = tmp_path / "state.ckpt"
    args = sql_args(table, source, target, "--checkpoint", str(checkpoint), "--batch-size", "20")
    process = subprocess.Popen(
        [*migrate_command(server, *args, "--concurrency", "1"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _wait_for_progress(checkpoint, 0, process)
    process.send_signal(signal.SIGSTOP)  # the key changes between two of its requests
    key = source if changed == "source" else target
    cryptd.update_key(key, state="disabled")
    process.send_signal(signal.SIGCONT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 3, err
    assert f"{key!r} is disabled" in err.decode() + out.decode()
    saved = json.loads(checkpoint.read_text())
    assert saved["done"] is False
    done = saved["committed"]["counts"]["migrated"]
    assert 0 < done < 6000
    cryptd.update_key(key, state="enabled")
    assert sum(decrypts_to(cryptd, target, table.rows())) == done

    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    _assert_exactly_once(report, 6000)
    assert all(decrypts_to(cryptd, target, table.rows()))


# -- crashes on either side of a commit, in-process -----------------------------------------


class _Crash(BaseException):
    pass


class _CrashingSource(SqlSource):
    """Stops the process (an exception nothing catches) at one point of its ``crash_at``-th
    write: before the commit, after the checkpoint that precedes it, or after it."""

    def __init__(self, *args: Any, crash_at: int, when: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crash_at, self.when, self.writes = crash_at, when, 0
        self.committed = 0  # rows committed before the crash
        self.crashing = 0  # rows of the write that crashes

    def write(self, group: Sequence[tuple[Page, Changes]], written: Written) -> None:
        self.writes += 1
        rows = sum(len(changes) for _, changes in group)
        if self.writes != self.crash_at:
            super().write(group, written)
            self.committed += rows
            return
        self.crashing = rows

        def then_crash(conflicts: Sequence[tuple[int, int]], witness: Any) -> None:
            written(conflicts, witness)
            if self.when == "before-commit":
                raise _Crash

        super().write(group, then_crash)
        raise _Crash  # after the commit, before the next checkpoint


def _run_in_process(
    server: Server, table: Table, source_key: str, target_key: str, checkpoint: Path, **crash: Any
) -> SqlSource:
    with client(server) as cryptd:
        source_info, target_info, _ = preflight(cryptd, source_key, target_key)
        if crash:
            cls = crash.pop("cls", _CrashingSource)
            source: SqlSource = cls(table.url, "t", "tok", "id", "aad", **crash)
        else:
            source = SqlSource(table.url, "t", "tok", "id", "aad")
        binding = {"source": source.identity(), "from_key": source_key, "to_key": target_key}
        log = FailureLog(checkpoint.with_name(checkpoint.name + ".failures.jsonl"))
        migration = Migration(
            source,
            Rewrapper(cryptd, source_info, target_info),
            Options(batch_size=40, concurrency=3),
            checkpoint=CheckpointFile(checkpoint, binding),
            failures=log,
        )
        try:
            migration.run()
        finally:
            source.close()
            log.close()
    return source


@pytest.mark.parametrize("when", ["before-commit", "after-commit"])
def test_a_crash_on_either_side_of_a_commit(
    server: Server, cryptd: CryptdClient, db_url: str, tmp_path: Path, when: str
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, db_url, source, 1200)  # 30 pages: groups of at most 6 (read-ahead)
    checkpoint = tmp_path / "crash.ckpt"
    crashing: list[_CrashingSource] = []

    class Recorded(_CrashingSource):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            crashing.append(self)

    with pytest.raises(_Crash):
        _run_in_process(
            server, table, source, target, checkpoint, crash_at=3, when=when, cls=Recorded
        )
    (crashed,) = crashing
    saved = json.loads(checkpoint.read_text())
    assert saved["pending"] is not None  # the group's checkpoint was written before its commit
    landed = sum(decrypts_to(cryptd, target, table.rows()))
    expected = crashed.committed + (crashed.crashing if when == "after-commit" else 0)
    assert crashed.committed > 0
    assert landed == expected
    status, report, stderr = run_migrate(
        server, *sql_args(table, source, target, "--checkpoint", str(checkpoint))
    )
    assert status == 0, stderr
    assert report is not None
    _assert_exactly_once(report, 1200)
    assert report["run"]["migrated"] == 1200 - landed
    assert all(decrypts_to(cryptd, target, table.rows()))


class _MeddlingSource(SqlSource):
    """The application writes to a row after the migration read it and before it is written."""

    def write(self, group: Sequence[tuple[Page, Changes]], written: Written) -> None:
        if any(7 in page.ids for page, _ in group):
            engine = sa.create_engine(self._url)
            with engine.begin() as conn:
                conn.exec_driver_sql("UPDATE t SET tok = 'changed by the app' WHERE id = 7")
            engine.dispose()
        super().write(group, written)


WRITERS = [
    ("sqlite", "sqlite"),
    ("sqlite", "generic"),
    ("postgresql", "postgresql"),
    ("postgresql", "pg-copy"),
    ("postgresql", "pg-executemany"),
    ("postgresql", "generic"),
]


@pytest.mark.parametrize(("database", "writer"), WRITERS)
def test_a_row_changed_during_the_migration_is_never_overwritten(
    server: Server,
    cryptd: CryptdClient,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    database: str,
    writer: str,
) -> None:
    """Every writer: a compare-and-set per row, the rows it wrote reported exactly."""
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'tokens.db'}"
    else:
        url = request.getfixturevalue("pg_database")
    source_key, target_key = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, url, source_key, 50)
    source_info, target_info, _ = preflight(cryptd, source_key, target_key)
    source = _MeddlingSource(table.url, "t", "tok", "id", "aad", writer=writer)
    log = FailureLog(tmp_path / "f.jsonl")
    try:
        result = Migration(
            source, Rewrapper(cryptd, source_info, target_info), Options(20, 2), failures=log
        ).run()
    finally:
        source.close()
        log.close()
    assert result.total.migrated == 49
    assert dict(result.total.failed) == {"changed_during_migration": 1}
    rows = {r[0]: r for r in table.rows()}
    assert rows[7][1] == "changed by the app"
    assert all(decrypts_to(cryptd, target_key, [r for i, r in rows.items() if i != 7]))
    assert [json.loads(x)["id"] for x in (tmp_path / "f.jsonl").read_text().splitlines()] == [7]


class _ResettingProxy:
    """A TCP proxy in front of the server that resets every ``every``-th connection at its
    second request, after reading it and before any answer (RST): a kept-alive connection cut
    by a network device or a restarting server, mid-request."""

    def __init__(self, upstream: str, every: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._every = every
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.resets = 0
        self._connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._connections += 1
            doomed = self._connections % self._every == 0
            upstream = socket.create_connection(self._upstream)
            threading.Thread(
                target=self._requests, args=(conn, upstream, doomed), daemon=True
            ).start()
            threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()

    def _requests(self, conn: socket.socket, upstream: socket.socket, doomed: bool) -> None:
        seen = 0
        try:
            while data := conn.recv(65536):
                if data.startswith((b"POST ", b"GET ", b"PATCH ")):
                    seen += 1
                    if doomed and seen == 2:
                        self.resets += 1
                        linger = struct.pack("ii", 1, 0)
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                        break
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)
            conn.close()

    def close(self) -> None:
        self._listener.close()


def test_connections_reset_under_the_run_are_retried(
    server: Server, cryptd: CryptdClient, tmp_path: Path
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 3000)
    proxy = _ResettingProxy(server.url, every=1)
    try:
        credential = json.loads((server.directory / "dev" / "client.json").read_text())
        flaky = tmp_path / "flaky.json"
        flaky.write_text(json.dumps({**credential, "url": proxy.url}))
        # Every connection is cut at its second request.
        args = sql_args(table, source, target, "--batch-size", "100", "--concurrency", "3")
        status, report, stderr = run_migrate(server, *args, credential_file=flaky)
    finally:
        proxy.close()
    assert status == 0, stderr[-3000:]
    assert proxy.resets > 0
    assert report is not None
    _assert_exactly_once(report, 3000)
    assert all(decrypts_to(cryptd, target, table.rows()))


class _RewritingApp(SqlSource):
    """The application, still on the old key, rewrites row 7 between the migration's read and
    its write: the compare-and-set leaves the row under the old key."""

    token = ""

    def write(self, group: Sequence[tuple[Page, Changes]], written: Written) -> None:
        if any(7 in page.ids for page, _ in group):
            engine = sa.create_engine(self._url)
            with engine.begin() as conn:
                conn.execute(sa.text("UPDATE t SET tok = :tok WHERE id = 7"), {"tok": self.token})
            engine.dispose()
        super().write(group, written)


def test_a_later_run_with_the_same_checkpoint_migrates_what_the_application_wrote(
    server: Server, cryptd: CryptdClient, pg_database: str, tmp_path: Path
) -> None:
    """A complete checkpoint starts a new pass over the table: the row that changed during the
    first pass, rows the application added and rewrote under the old key afterwards are
    migrated, and nothing already under the target key is done again."""
    source_key, target_key = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, pg_database, source_key, 200)
    checkpoint_path = tmp_path / "app.ckpt"
    source_info, target_info, _ = preflight(cryptd, source_key, target_key)
    source = _RewritingApp(table.url, "t", "tok", "id", "aad")
    plain7 = b"written by the app during the run"
    source.token = cryptd.encrypt(source_key, plain7, aad=b"row-6").ciphertext
    binding = {"source": source.identity(), "from_key": source_key, "to_key": target_key}
    log = FailureLog(tmp_path / "app.ckpt.failures.jsonl")
    try:
        result = Migration(
            source,
            Rewrapper(cryptd, source_info, target_info),
            Options(50, 2),
            checkpoint=CheckpointFile(checkpoint_path, binding),
            failures=log,
        ).run()
    finally:
        source.close()
        log.close()
    assert result.complete
    assert result.pass_number == 1
    assert dict(result.total.failed) == {"changed_during_migration": 1}
    assert json.loads(checkpoint_path.read_text())["done"] is True
    table.execute(f"UPDATE t SET pt = '\\x{plain7.hex()}'::bytea WHERE id = 7")

    # After the first pass: a writer still on the old key adds ten rows and rewrites row 3.
    added = [os.urandom(16) for _ in range(10)]
    tokens = encrypt(cryptd, source_key, added, [f"new-{i}".encode() for i in range(10)])
    table.insert([(201 + i, tokens[i], added[i], f"new-{i}".encode()) for i in range(10)])
    row3 = cryptd.encrypt(source_key, b"rewritten", aad=b"row-2").ciphertext
    rewritten = b"rewritten".hex()
    table.execute(f"UPDATE t SET tok = '{row3}', pt = '\\x{rewritten}'::bytea WHERE id = 3")

    args = sql_args(table, source_key, target_key, "--checkpoint", str(checkpoint_path))
    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    assert report["pass"] == 2
    assert report["status"] == "complete"
    assert report["total"]["migrated"] == 12  # row 7, row 3 and the ten new rows
    assert report["total"]["skipped"] == {"already_under_target": 198}
    assert report["total"]["failed"] == {}
    assert all(decrypts_to(cryptd, target_key, table.rows()))
    assert (tmp_path / "app.ckpt.failures.jsonl").read_text() == ""  # this pass's failures

    # Nothing left: the next pass migrates nothing and changes no row.
    before = table.rows()
    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    assert report["pass"] == 3
    assert report["total"]["migrated"] == 0
    assert report["total"]["skipped"] == {"already_under_target": 210}
    assert table.rows() == before
