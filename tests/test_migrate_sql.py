"""``cryptd migrate`` on SQL tables (SQLite and PostgreSQL), against a real server: every
migrated row decrypts under the new key to its original plaintext, every bad row is reported
and left as it was, and the refusals say why."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryptd_client import CryptdClient
from tests.conftest import Server, start_server, stop_server
from tests.migrate_support import (
    Table,
    client,
    decrypts_to,
    encrypt,
    new_key,
    run_migrate,
    sql_args,
    table_of,
)

pytestmark = pytest.mark.slow  # a live server, PostgreSQL and the migration tool


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


def _damage(token: str) -> str:
    """Change one character in the middle of the token's body (still well-formed)."""
    middle = len(token) // 2 + 5
    replacement = "A" if token[middle] != "A" else "B"
    return token[:middle] + replacement + token[middle + 1 :]


def test_migrates_every_row_and_reports_every_bad_one(
    server: Server, cryptd: CryptdClient, db_url: str, tmp_path: Path
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    third_of_source_type = new_key(cryptd, "aes256-gcm")
    third_of_target_type = new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, db_url, source, 1200)
    pt = b"a bad row"

    def one(key: str, aad: bytes | None = None) -> str:
        return encrypt(cryptd, key, [pt], [aad])[0]

    bad: list[tuple[Any, Any, bytes | None, bytes | None]] = [
        (2001, None, None, None),  # NULL: skipped
        (2002, _damage(one(source)), pt, None),  # damaged body: decryption_failed
        (2003, "hello", pt, None),  # not a token
        (2004, one(third_of_source_type), pt, None),  # a third key, the source's type
        (2005, one(third_of_target_type), pt, None),  # a third key, the target's type
        (2006, one("rsa-2048"), pt, None),  # a third key of another type
        (2007, one(target, b"a"), pt, b"a"),  # already under the target: skipped
        (2008, one(source, b"a"), pt, b"b"),  # the wrong aad
        (2009, "cryptd:v1:ZZZZ" + one(source)[14:], pt, None),  # damaged header
    ]
    table.insert(bad)
    before = {r[0]: r for r in table.rows()}
    checkpoint = tmp_path / "run.ckpt"
    args = sql_args(table, source, target, "--checkpoint", str(checkpoint), "--batch-size", "250")

    status, report, stderr = run_migrate(server, *args, "--verify", "30")
    assert status == 1, stderr  # done, with failed rows
    assert report is not None, stderr
    assert report["status"] == "complete"
    total = report["total"]
    assert total["migrated"] == 1200
    assert total["skipped"] == {"already_under_target": 1, "null": 1}
    assert total["failed"] == {
        "damaged_token": 1,
        "decryption_failed": 4,
        "not_a_token": 1,
        "other_key_type": 1,
    }
    # Up to 30 migrated rows, spread over the table (the last rows here do not migrate).
    assert 25 <= total["verified"] <= 30
    assert report["run"]["rows_per_second"] > 0

    after = {r[0]: r for r in table.rows()}
    assert all(decrypts_to(cryptd, target, [after[i] for i in range(1, 1201)]))
    assert {i: after[i] for i in before if i > 2000} == {i: before[i] for i in before if i > 2000}

    log = checkpoint.with_name("run.ckpt.failures.jsonl")
    failures = [json.loads(line) for line in log.read_text().splitlines()]
    reasons = {f["id"]: f["reason"] for f in failures}
    assert reasons == {
        2002: "decryption_failed",
        2003: "not_a_token",
        2004: "decryption_failed",
        2005: "decryption_failed",
        2006: "other_key_type",
        2008: "decryption_failed",
        2009: "damaged_token",
    }
    assert "cryptd:v1:" not in log.read_text()  # the log names rows, never tokens

    # The same command again: a new pass over the table finds nothing left under the source
    # key; the rows that cannot migrate fail again and are listed again.
    status, report, _ = run_migrate(server, *args)
    assert status == 1
    assert report is not None
    assert report["pass"] == 2
    assert report["total"]["migrated"] == 0
    assert report["total"]["skipped"] == {"already_under_target": 1201, "null": 1}
    assert sum(report["total"]["failed"].values()) == len(reasons)
    assert table.rows() == list(after.values())

    # A fresh run (no checkpoint) asks the service and skips what is under the target key.
    status, report, _ = run_migrate(server, *sql_args(table, source, target))
    assert report is not None
    assert report["total"]["migrated"] == 0
    assert report["total"]["skipped"] == {"already_under_target": 1201, "null": 1}
    assert table.rows() == list(after.values())


def test_rsa_to_sm2_with_verification(server: Server, cryptd: CryptdClient, db_url: str) -> None:
    source, target = new_key(cryptd, "rsa-2048"), new_key(cryptd, "sm2")
    table = table_of(cryptd, db_url, source, 300)
    status, report, stderr = run_migrate(
        server, *sql_args(table, source, target, "--batch-size", "64"), "--verify", "300"
    )
    assert status == 0, stderr
    assert report is not None
    assert report["total"]["migrated"] == 300
    assert report["total"]["verified"] == 300
    assert all(decrypts_to(cryptd, target, table.rows()))


def test_same_type_migration_tells_rows_apart_through_the_service(
    server: Server, cryptd: CryptdClient, db_url: str
) -> None:
    """AES to AES: the token's type id cannot tell old from new, the probe can."""
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "aes256-gcm")
    third = new_key(cryptd, "aes256-gcm")
    table = table_of(cryptd, db_url, source, 400)
    table.insert(
        [
            (1001, encrypt(cryptd, target, [b"new"], [None])[0], b"new", None),
            (1002, encrypt(cryptd, third, [b"3rd"], [None])[0], b"3rd", None),
        ]
    )
    status, report, stderr = run_migrate(server, *sql_args(table, source, target))
    assert status == 1, stderr
    assert report is not None
    assert report["total"]["migrated"] == 400
    assert report["total"]["skipped"] == {"already_under_target": 1}
    assert report["total"]["failed"] == {"decryption_failed": 1}
    rows = table.rows()
    assert decrypts_to(cryptd, target, rows) == [True] * 401 + [False]


def test_dry_run_writes_nothing(
    server: Server, cryptd: CryptdClient, db_url: str, tmp_path: Path
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, db_url, source, 300)
    table.insert([(1000, "junk", None, None)])
    before = table.rows()
    checkpoint = tmp_path / "dry.ckpt"
    status, report, stderr = run_migrate(
        server, *sql_args(table, source, target, "--dry-run", "--checkpoint", str(checkpoint))
    )
    assert status == 1, stderr
    assert report is not None
    assert report["dry_run"] is True
    assert report["total"]["migrated"] == 300
    assert report["total"]["failed"] == {"not_a_token": 1}
    assert table.rows() == before
    assert not checkpoint.exists()


def test_rows_sharing_an_id_are_reported_and_left_alone(
    server: Server, cryptd: CryptdClient, db_url: str
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    plaintexts = [f"p{i}".encode() for i in range(60)]
    tokens = encrypt(cryptd, source, plaintexts, [None] * 60)
    ids: list[int | None] = [i // 2 if 20 <= i < 26 else i for i in range(60)]  # 10-12 twice
    ids += [None, None]
    rows = [(ids[i], tokens[i], plaintexts[i], None) for i in range(60)]
    rows += [(None, tokens[0], plaintexts[0], None)] * 2  # NULL ids
    table = Table(db_url)
    table.create(rows, primary_key=False)
    # Pages of 7 end inside groups of duplicates: the group is completed, never split.
    status, report, stderr = run_migrate(
        server, *sql_args(table, source, target, "--batch-size", "7")
    )
    assert status == 1, stderr
    assert report is not None
    duplicated = sum(1 for i in ids[:60] if ids[:60].count(i) > 1)
    assert report["total"]["failed"] == {"duplicate_id": duplicated, "null_id": 2}
    assert report["total"]["migrated"] == 60 - duplicated
    after = table.rows()
    for row, ok in zip(after, decrypts_to(cryptd, target, after), strict=True):
        shared = row[0] is None or ids[:60].count(row[0]) > 1
        assert ok is not shared


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--id-column", "nope"], "has no id column 'nope'"),
        (["--column", "nope"], "has no ciphertext column 'nope'"),
        (["--table", "missing"], "there is no table 'missing'"),
    ],
)
def test_refuses_a_table_it_cannot_use(
    server: Server, cryptd: CryptdClient, tmp_path: Path, change: list[str], message: str
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 3)
    args = sql_args(table, source, target)
    flag = change[0]
    args[args.index(flag) + 1] = change[1]
    status, report, stderr = run_migrate(server, *args)
    assert status == 2
    assert report is None
    assert message in stderr
    assert "Traceback" not in stderr
    assert all(decrypts_to(cryptd, source, table.rows()))


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        (("aes256-gcm", "ecdsa-p256"), "cannot encrypt"),
        (("aes256-gcm", "same"), "are the same key"),
        (("aes256-gcm", "no-such-key"), "has no key 'no-such-key'"),
    ],
)
def test_refuses_keys_that_cannot_work(
    server: Server, cryptd: CryptdClient, tmp_path: Path, pair: tuple[str, str], message: str
) -> None:
    source = new_key(cryptd, pair[0])
    target = {"same": source, "no-such-key": "no-such-key"}.get(pair[1]) or new_key(cryptd, pair[1])
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 3)
    status, _, stderr = run_migrate(server, *sql_args(table, source, target))
    assert status == 2
    assert message in stderr


@pytest.mark.parametrize(
    ("source_state", "target_state", "message"),
    [
        ("enabled", "decrypt_only", "is decrypt_only: it takes no new encryptions"),
        ("enabled", "disabled", "is disabled: it takes no new encryptions"),
        ("disabled", "enabled", "is disabled: nothing can be decrypted under it"),
    ],
)
def test_refuses_keys_whose_state_lets_no_row_migrate(
    server: Server,
    cryptd: CryptdClient,
    tmp_path: Path,
    source_state: str,
    target_state: str,
    message: str,
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 3)
    for name, state in ((source, source_state), (target, target_state)):
        cryptd.update_key(name, state=state)
    status, report, stderr = run_migrate(server, *sql_args(table, source, target))
    assert status == 2
    assert report is None
    assert message in stderr
    assert "Traceback" not in stderr
    cryptd.update_key(source, state="enabled")
    assert all(decrypts_to(cryptd, source, table.rows()))


def test_a_decrypt_only_source_migrates(
    server: Server, cryptd: CryptdClient, tmp_path: Path
) -> None:
    """Phase 1 of docs/MIGRATION.md: the old key decrypt-only, then its data moved."""
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 20)
    cryptd.update_key(source, state="decrypt_only")
    status, report, stderr = run_migrate(server, *sql_args(table, source, target))
    assert status == 0, stderr
    assert report is not None
    assert report["total"]["migrated"] == 20
    assert all(decrypts_to(cryptd, target, table.rows()))


def test_a_checkpoint_of_another_migration_is_refused(
    server: Server, cryptd: CryptdClient, tmp_path: Path
) -> None:
    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    table = table_of(cryptd, f"sqlite:///{tmp_path / 'x.db'}", source, 10)
    checkpoint = tmp_path / "c.ckpt"
    assert (
        run_migrate(server, *sql_args(table, source, target, "--checkpoint", str(checkpoint)))[0]
        == 0
    )
    other = new_key(cryptd, "sm4-gcm")
    status, _, stderr = run_migrate(
        server, *sql_args(table, source, other, "--checkpoint", str(checkpoint))
    )
    assert status == 2
    assert "belongs to another migration" in stderr


def test_requests_fit_the_service_limits(tmp_path: Path) -> None:
    """A service with small limits: pages are cut to fit its body and batch limits (413
    halves the request), and the one row too large for any request fails alone."""
    limited = start_server(
        tmp_path / "server",
        {"CRYPTD_MAX_BATCH_ITEMS": "40", "CRYPTD_MAX_BODY_BYTES": "30000"},
    )
    try:
        with client(limited) as cryptd:
            source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
            sizes = [10, 2000, 50, 8000, 20, 300] * 40
            plaintexts = [os.urandom(n) for n in sizes]
            tokens = [encrypt(cryptd, source, [p], [None])[0] for p in plaintexts]
            # A token with a good header, too long for any request (the body never gets read).
            tokens.append(tokens[0][:14] + "A" * 34000)
            plaintexts.append(b"")
            table = Table(f"sqlite:///{tmp_path / 'limits.db'}")
            rows = zip(tokens, plaintexts, strict=True)
            table.create([(i + 1, t, p, None) for i, (t, p) in enumerate(rows)])
            status, report, stderr = run_migrate(
                limited, *sql_args(table, source, target, "--batch-size", "500")
            )
            assert status == 1, stderr
            assert report is not None
            assert report["total"]["migrated"] == 240
            assert report["total"]["failed"] == {"payload_too_large": 1}
            after = table.rows()
            assert all(
                all(decrypts_to(cryptd, target, after[i : i + 10])) for i in range(0, 240, 10)
            )
            assert after[240][1] == tokens[240]
    finally:
        stop_server(limited)


def test_an_overloaded_service_gets_smaller_requests(tmp_path: Path) -> None:
    """A service whose work queue holds few tasks answers big batches 503: the tool halves the
    requests it cannot finish and completes the run."""
    small = start_server(tmp_path / "server", {"CRYPTD_POOL_MAX_PENDING": "4"})
    try:
        with client(small) as cryptd:
            source, target = new_key(cryptd, "rsa-2048"), new_key(cryptd, "sm2")
            table = table_of(cryptd, f"sqlite:///{tmp_path / 'busy.db'}", source, 1200, chunk=20)
            status, report, stderr = run_migrate(
                small, *sql_args(table, source, target, "--batch-size", "600")
            )
            assert status == 0, stderr
            assert report is not None
            assert report["total"]["migrated"] == 1200
            assert all(decrypts_to(cryptd, target, table.rows(), batch=20))
        assert "overloaded" in small.log()  # the service did refuse some requests
    finally:
        stop_server(small)


def test_uuid_ids_and_binary_token_columns(
    server: Server, cryptd: CryptdClient, pg_database: str, tmp_path: Path
) -> None:
    """PostgreSQL UUID ids (kept in the checkpoint with their type) and BYTEA tokens (written
    back as bytes)."""
    import uuid

    source, target = new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")
    plaintexts = [os.urandom(12) for _ in range(300)]
    tokens = encrypt(cryptd, source, plaintexts, [None] * 300)
    table = Table(pg_database)
    rows = [(uuid.uuid4(), t.encode(), p, None) for t, p in zip(tokens, plaintexts, strict=True)]
    table.create(rows, id_type="UUID", tok_type="BYTEA")
    checkpoint = tmp_path / "u.ckpt"
    args = sql_args(table, source, target, "--batch-size", "64", "--checkpoint", str(checkpoint))
    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    assert report["total"]["migrated"] == 300
    saved = json.loads(checkpoint.read_text())
    assert set(saved["committed"]["position"]["after"]) == {"uuid"}
    after = table.rows()
    assert all(isinstance(r[1], bytes) for r in after)
    assert all(decrypts_to(cryptd, target, after))
