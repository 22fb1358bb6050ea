"""Helpers for the ``cryptd migrate`` tests: tables of real tokens, runs of the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from cryptd_client import CryptdClient, DecryptResult
from tests.conftest import Server


def credential(server: Server) -> Path:
    return server.directory / "dev" / "client.json"


def client(server: Server) -> CryptdClient:
    return CryptdClient.from_file(credential(server), timeout=120)


def new_key(cryptd: CryptdClient, type_name: str) -> str:
    name = f"mig-{type_name}-{uuid.uuid4().hex[:8]}"
    cryptd.create_key(name, type_name)
    return name


def encrypt(
    cryptd: CryptdClient, key: str, plaintexts: Sequence[bytes], aads: Sequence[bytes | None]
) -> list[str]:
    items = [{"plaintext": p, "aad": a} for p, a in zip(plaintexts, aads, strict=True)]
    tokens: list[str] = []
    for result in cryptd.encrypt_batch(key, items):
        assert not isinstance(result, Exception), result
        tokens.append(result.ciphertext)
    return tokens


@dataclass
class Table:
    """A table ``t(id, tok, pt, aad)`` of tokens and the plaintexts they hold."""

    url: str
    name: str = "t"

    def engine(self) -> sa.Engine:
        url = sa.make_url(self.url)
        if url.drivername == "postgresql":
            url = url.set(drivername="postgresql+psycopg")
        return sa.create_engine(url)

    def create(
        self,
        rows: Sequence[tuple[Any, str | bytes | None, bytes | None, bytes | None]],
        *,
        id_type: str = "INTEGER",
        tok_type: str = "TEXT",
        primary_key: bool = True,
    ) -> None:
        engine = self.engine()
        blob = "BYTEA" if engine.dialect.name == "postgresql" else "BLOB"
        key = " PRIMARY KEY" if primary_key else ""
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"CREATE TABLE {self.name} (id {id_type}{key}, tok {tok_type}, "
                f"pt {blob}, aad {blob})"
            )
        engine.dispose()
        if rows:
            self.insert(rows)

    def insert(self, rows: Sequence[tuple[Any, Any, bytes | None, bytes | None]]) -> None:
        engine = self.engine()
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"INSERT INTO {self.name} VALUES (:id, :tok, :pt, :aad)"),
                [{"id": r[0], "tok": r[1], "pt": r[2], "aad": r[3]} for r in rows],
            )
        engine.dispose()

    def rows(self) -> list[tuple[Any, Any, bytes | None, bytes | None]]:
        engine = self.engine()
        with engine.connect() as conn:
            result = conn.exec_driver_sql(f"SELECT id, tok, pt, aad FROM {self.name} ORDER BY id")
            rows = [(r[0], r[1], r[2], r[3]) for r in result]
        engine.dispose()
        return rows

    def execute(self, sql: str) -> None:
        engine = self.engine()
        with engine.begin() as conn:
            conn.exec_driver_sql(sql)
        engine.dispose()


def table_of(
    cryptd: CryptdClient,
    url: str,
    key: str,
    count: int,
    *,
    with_aad: bool = True,
    chunk: int = 1000,
) -> Table:
    plaintexts = [os.urandom(1 + i % 40) for i in range(count)]
    aads = [f"row-{i}".encode() if with_aad else None for i in range(count)]
    tokens: list[str] = []
    for start in range(0, count, chunk):
        part = slice(start, start + chunk)
        tokens += encrypt(cryptd, key, plaintexts[part], aads[part])
    table = Table(url)
    table.create([(i + 1, tokens[i], plaintexts[i], aads[i]) for i in range(count)])
    return table


def decrypts_to(
    cryptd: CryptdClient,
    key: str,
    rows: Sequence[tuple[Any, Any, bytes | None, bytes | None]],
    batch: int = 1000,
) -> list[bool]:
    """For each row: does its token decrypt under ``key`` to its plaintext column?"""
    results: list[bool] = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        items = [
            {"ciphertext": r[1].decode() if isinstance(r[1], bytes) else r[1], "aad": r[3]}
            for r in chunk
        ]
        for row, result in zip(chunk, cryptd.decrypt_batch(key, items), strict=True):
            results.append(isinstance(result, DecryptResult) and result.plaintext == row[2])
    return results


def migrate_command(server: Server, *args: str, credential_file: Path | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "service",
        "migrate",
        "--credential",
        str(credential_file or credential(server)),
        "--no-progress",
        *args,
    ]


def run_migrate(
    server: Server, *args: str, timeout: float = 300, credential_file: Path | None = None
) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``cryptd migrate --json``; return (exit status, report, stderr)."""
    done = subprocess.run(
        [*migrate_command(server, *args, credential_file=credential_file), "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    report = json.loads(done.stdout) if done.stdout.strip() else None
    return done.returncode, report, done.stderr


def sql_args(table: Table, source: str, target: str, *extra: str) -> list[str]:
    return [
        "--from-key",
        source,
        "--to-key",
        target,
        "--url",
        table.url,
        "--table",
        table.name,
        "--column",
        "tok",
        "--id-column",
        "id",
        "--aad-column",
        "aad",
        *extra,
    ]
