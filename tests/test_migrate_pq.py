"""``cryptd migrate`` to a post-quantum key: RSA-OAEP tokens re-encrypted under X-Wing
(``x25519-ml-kem-768``) through rewrap with ``to_key``, the migration SIGKILLed part way and
resumed. Every token ends under the new key, decrypting to its own plaintext, none lost and
none done twice.

CI runs 500 tokens; ``CRYPTD_PQ_MIGRATE_ROWS=10000`` runs the full-size version
(docs/MIGRATION.md, "Post-quantum").
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cryptd_client import CryptdClient
from service.crypto.registry import KEY_TYPES
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
from tests.test_migrate_resume import _committed, _wait_for_progress

pytestmark = pytest.mark.slow  # a live server, the migration tool killed and resumed

ROWS = int(os.environ.get("CRYPTD_PQ_MIGRATE_ROWS", "500"))


def _type_id(token: str) -> int:
    body = token.split(":", 2)[2]
    return base64.urlsafe_b64decode(body[:4])[1]


def test_rsa_oaep_to_xwing_sigkilled_and_resumed(server: Server, tmp_path: Path) -> None:
    cryptd: CryptdClient
    with client(server) as cryptd:
        source, target = new_key(cryptd, "rsa-2048"), new_key(cryptd, "x25519-ml-kem-768")
        table = table_of(cryptd, f"sqlite:///{tmp_path / 'tokens.db'}", source, ROWS)
        before = table.rows()
        assert {_type_id(r[1]) for r in before} == {KEY_TYPES["rsa-2048"].type_id}
        checkpoint = tmp_path / "pq.ckpt"
        batch = "20" if ROWS <= 1000 else "100"
        args = sql_args(
            table, source, target, "--checkpoint", str(checkpoint), "--batch-size", batch
        )
        with subprocess.Popen(
            migrate_command(server, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        ) as process:
            _wait_for_progress(checkpoint, ROWS // 5, process)
            process.send_signal(signal.SIGKILL)
            assert process.wait(timeout=30) == -signal.SIGKILL
        killed_at = _committed(checkpoint)
        assert killed_at < ROWS, "the run finished before it could be killed"
        # The rows committed before the kill are X-Wing tokens already; the rest still RSA.
        midway = table.rows()
        xwing_id = KEY_TYPES["x25519-ml-kem-768"].type_id
        assert sum(_type_id(r[1]) == xwing_id for r in midway) >= killed_at

        started = time.monotonic()
        status, report, stderr = run_migrate(server, *args, "--verify", "20")
        assert status == 0, stderr
        assert report is not None
        assert report["resumed"] is True
        total = report["total"]
        assert total["migrated"] == ROWS  # each row once: nothing redone, nothing lost
        assert total["skipped"] == {}
        assert total["failed"] == {}
        assert total["verified"] >= 1
        assert time.monotonic() - started < 600

        after = table.rows()
        assert [r[0] for r in after] == [r[0] for r in before]
        assert {_type_id(r[1]) for r in after} == {xwing_id}
        assert all(decrypts_to(cryptd, target, after))
        # The tokens are bound to their row's aad: a swapped aad does not decrypt.
        swapped = [(r[0], r[1], r[2], after[(i + 1) % len(after)][3]) for i, r in enumerate(after)]
        assert not any(decrypts_to(cryptd, target, swapped[:50]))
        # The source key still opens what the table held before (nothing was changed in place).
        assert all(decrypts_to(cryptd, source, before[:50]))


def test_a_column_too_narrow_for_xwing_tokens_stops_the_run_and_changes_nothing(
    server: Server, pg_database: str, tmp_path: Path
) -> None:
    """An X-Wing token of a 32-byte value is 1,570 characters: a VARCHAR(512) column written
    with RSA-2048 tokens (437) cannot hold it. The run stops (exit 3) without a row changed,
    and after the column is widened the same command migrates every row."""
    with client(server) as cryptd:
        source, target = new_key(cryptd, "rsa-2048"), new_key(cryptd, "x25519-ml-kem-768")
        plaintexts = [os.urandom(32) for _ in range(30)]
        aads = [f"row-{i}".encode() for i in range(30)]
        tokens = encrypt(cryptd, source, plaintexts, aads)
        table = Table(pg_database)
        rows = [(i + 1, tokens[i], plaintexts[i], aads[i]) for i in range(30)]
        table.create(rows, tok_type="VARCHAR(512)")
        checkpoint = tmp_path / "narrow.ckpt"
        args = sql_args(table, source, target, "--checkpoint", str(checkpoint))
        status, report, stderr = run_migrate(server, *args)
        assert status == 3, stderr
        assert report is not None
        assert report["total"]["migrated"] == 0
        assert table.rows() == rows
        table.execute("ALTER TABLE t ALTER COLUMN tok TYPE TEXT")
        status, report, stderr = run_migrate(server, *args)
        assert status == 0, stderr
        assert report is not None
        assert report["total"]["migrated"] == 30
        assert all(decrypts_to(cryptd, target, table.rows()))
