"""``cryptd migrate`` on JSONL and CSV files: the output holds every input record in order,
migrated ones with their new token and otherwise byte for byte as they were; a killed run
resumes by cutting the output back to its checkpointed length."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryptd_client import CryptdClient, DecryptResult
from tests.conftest import Server
from tests.migrate_support import client, encrypt, migrate_command, new_key, run_migrate

pytestmark = pytest.mark.slow  # a live server and the migration tool


@pytest.fixture
def cryptd(server: Server) -> Iterator[CryptdClient]:
    with client(server) as c:
        yield c


@pytest.fixture
def keys(cryptd: CryptdClient) -> tuple[str, str]:
    return new_key(cryptd, "aes256-gcm"), new_key(cryptd, "sm4-gcm")


def _tokens(cryptd: CryptdClient, key: str, count: int) -> tuple[list[bytes], list[str]]:
    plaintexts = [os.urandom(8) + i.to_bytes(4, "big") for i in range(count)]
    tokens: list[str] = []
    for start in range(0, count, 1000):
        chunk = plaintexts[start : start + 1000]
        tokens += encrypt(cryptd, key, chunk, [f"r{start + j}".encode() for j in range(len(chunk))])
    return plaintexts, tokens


def _decrypt(cryptd: CryptdClient, key: str, tokens: list[str], aads: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for start in range(0, len(tokens), 1000):
        items = [
            {"ciphertext": t, "aad": a}
            for t, a in zip(tokens[start : start + 1000], aads[start : start + 1000], strict=True)
        ]
        for result in cryptd.decrypt_batch(key, items):
            assert isinstance(result, DecryptResult), result
            out.append(result.plaintext)
    return out


def _file_args(source: str, target: str, path: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--from-key", source, "--to-key", target, "--input", str(path), "--out", str(out),
        "--aad-field", "aad", *extra,
    ]  # fmt: skip


def test_jsonl_keeps_every_record_and_its_bytes(
    server: Server, cryptd: CryptdClient, keys: tuple[str, str], tmp_path: Path
) -> None:
    source, target = keys
    plaintexts, tokens = _tokens(cryptd, source, 300)
    lines = [
        # spacing, key order, unicode and a 70-digit integer survive as they were
        f'{{ "id": {i}, "name": "zoë", "big": {10**70}, "aad": "r{i}", "tok": "{t}" }}'
        for i, t in enumerate(tokens)
    ]
    lines.insert(10, "")  # a blank line: copied
    lines.insert(20, "not json")  # a bad record: copied and reported
    lines.insert(30, '{"id": -1, "tok": null}')  # NULL: skipped
    lines.insert(40, '{"id": -2}')  # no field: skipped
    lines.insert(50, '{"id": -3, "tok": 5}')  # not text: failed
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    status, report, stderr = run_migrate(
        server, *_file_args(source, target, path, out, "--field", "tok", "--batch-size", "64")
    )
    assert status == 1, stderr
    assert report is not None
    assert report["total"]["migrated"] == 300
    assert report["total"]["skipped"] == {"null": 2}
    assert report["total"]["failed"] == {"bad_record": 1, "not_text": 1}
    produced = out.read_text(encoding="utf-8").split("\n")
    original = path.read_text(encoding="utf-8").split("\n")
    assert len(produced) == len(original)
    new_tokens: list[str] = []
    for before, after in zip(original, produced, strict=True):
        if '"tok": "cryptd:' not in before:
            assert after == before
            continue
        old = json.loads(before)["tok"]
        new_tokens.append(json.loads(after)["tok"])
        assert after == before.replace(old, new_tokens[-1])
    aads = [f"r{i}".encode() for i in range(300)]
    assert _decrypt(cryptd, target, new_tokens, aads) == plaintexts


def test_csv_with_quotes_and_multi_line_fields(
    server: Server, cryptd: CryptdClient, keys: tuple[str, str], tmp_path: Path
) -> None:
    source, target = keys
    plaintexts, tokens = _tokens(cryptd, source, 120)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(["id", "note", "aad", "tok"])
    for i, token in enumerate(tokens):
        writer.writerow([i, f'line one\nline "two", {i}', f"r{i}", token])
    writer.writerow([999, "empty token", "x", ""])
    writer.writerow([1000, "too short"])
    path, out = tmp_path / "in.csv", tmp_path / "out.csv"
    path.write_text(buffer.getvalue(), encoding="utf-8")
    status, report, stderr = run_migrate(
        server, *_file_args(source, target, path, out, "--column", "tok", "--batch-size", "50")
    )
    assert status == 1, stderr
    assert report is not None
    assert report["total"]["migrated"] == 120
    assert report["total"]["skipped"] == {"null": 1}
    assert report["total"]["failed"] == {"bad_record": 1}
    before = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
    after = list(csv.reader(io.StringIO(out.read_text(encoding="utf-8"))))
    assert len(after) == len(before)
    for old, new in zip(before[1:121], after[1:121], strict=True):
        assert old[:3] == new[:3]
        assert new[3] != old[3]
    assert after[0] == before[0]
    assert after[121:] == before[121:]
    aads = [f"r{i}".encode() for i in range(120)]
    assert _decrypt(cryptd, target, [r[3] for r in after[1:121]], aads) == plaintexts


def test_a_killed_file_migration_resumes_without_duplicates(
    server: Server, cryptd: CryptdClient, keys: tuple[str, str], tmp_path: Path
) -> None:
    source, target = keys
    count = 12000
    plaintexts, tokens = _tokens(cryptd, source, count)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(
        "".join(json.dumps({"n": i, "aad": f"r{i}", "tok": t}) + "\n" for i, t in enumerate(tokens))
    )
    checkpoint = tmp_path / "f.ckpt"
    args = _file_args(
        source, target, path, out, "--field", "tok", "--checkpoint", str(checkpoint),
        "--batch-size", "100",
    )  # fmt: skip
    for _ in range(3):
        size = out.stat().st_size if out.exists() else 0
        with subprocess.Popen(
            migrate_command(server, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        ) as process:
            deadline = time.monotonic() + 60
            while not out.exists() or out.stat().st_size <= size + 20000:
                assert process.poll() is None, process.communicate()[1]
                assert time.monotonic() < deadline
                time.sleep(0.01)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    assert report["total"]["migrated"] == count
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["n"] for r in records] == list(range(count))
    aads = [f"r{i}".encode() for i in range(count)]
    assert _decrypt(cryptd, target, [r["tok"] for r in records], aads) == plaintexts

    # A file is read once: its complete checkpoint means done, the output stays as it is.
    written = out.read_bytes()
    status, report, stderr = run_migrate(server, *args)
    assert status == 0, stderr
    assert report is not None
    assert report["pass"] == 1
    assert report["run"]["rows"] == 0
    assert report["total"]["migrated"] == count
    assert out.read_bytes() == written


def test_refusals_for_files(
    server: Server, cryptd: CryptdClient, keys: tuple[str, str], tmp_path: Path
) -> None:
    source, target = keys
    path, out = tmp_path / "in.csv", tmp_path / "out.csv"
    path.write_text("id,aad,tok\n1,a,x\n")
    status, _, stderr = run_migrate(
        server, *_file_args(source, target, path, out, "--column", "nope")
    )
    assert status == 2
    assert "has no column 'nope'" in stderr
    out.write_text("something\n")
    status, _, stderr = run_migrate(
        server, *_file_args(source, target, path, out, "--column", "tok")
    )
    assert status == 2
    assert "exists" in stderr
    assert out.read_text() == "something\n"
    status, _, stderr = run_migrate(
        server, *_file_args(source, target, path, path, "--column", "tok")
    )
    assert status == 2
    assert "must not be the input" in stderr
