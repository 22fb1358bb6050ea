"""JSONL and CSV files as migration sources: read the input in order, write ``--out``.

The input is never changed. Every record goes to the output in its input order, migrated or
as it was (a record that fails is copied unchanged, so nothing is lost), byte for byte except
for the token: the old token is replaced in the record's own bytes when it occurs there once,
and the record is re-serialised only otherwise. The position is a pair of byte offsets (input,
output); on resume the output is cut back to its checkpointed length and the input read from
its offset, so no record is written twice or dropped.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from .model import FAIL_BAD_RECORD, FAIL_NOT_TEXT, MigrationRefused, Page
from .source import Changes, Written

_CHUNK = 1 << 20


def _text(value: Any) -> tuple[str | None, tuple[str, str] | None]:
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, None
    return None, (FAIL_NOT_TEXT, f"the value is a JSON {type(value).__name__}, not a token")


def _aad(value: Any) -> bytes | None:
    if value is None or value == "":
        return None
    return value.encode("utf-8") if isinstance(value, str) else str(value).encode("utf-8")


def _line_ending(raw: bytes) -> bytes:
    if raw.endswith(b"\r\n"):
        return b"\r\n"
    return b"\n" if raw.endswith(b"\n") else b""


def _count_lines(handle: BinaryIO) -> int:
    start = handle.tell()
    count = 0
    last = b"\n"
    while chunk := handle.read(_CHUNK):
        count += chunk.count(b"\n")
        last = chunk
    if not last.endswith(b"\n"):
        count += 1
    handle.seek(start)
    return count


# A record's row: (number, token, aad, failure).
_Row = tuple[int, str | None, bytes | None, tuple[str, str] | None]


class _Record:
    """One input record: its bytes, what was parsed from it (a JSON object, CSV fields) and
    its row (None: copied through without being a row, e.g. a blank line)."""

    __slots__ = ("index", "parsed", "raw", "row")

    def __init__(self, raw: bytes, parsed: Any = None, row: _Row | None = None) -> None:
        self.raw = raw
        self.parsed = parsed
        self.row = row
        self.index = -1  # the row's place in its page


class _FileSource:
    repeatable = False
    kind = "file"

    def __init__(
        self,
        path: Path,
        field: str,
        out: Path | None,
        aad_field: str | None = None,
        *,
        dry_run: bool = False,
    ) -> None:
        self._path = Path(path)
        self._field = field
        self._aad_field = aad_field
        self._out_path = None if out is None else Path(out)
        self._dry_run = dry_run
        try:
            stat = os.stat(self._path)
        except OSError as exc:
            raise MigrationRefused(f"cannot read {self._path}: {exc.strerror}") from None
        self._stat = (stat.st_size, stat.st_mtime_ns)
        if not dry_run:
            if self._out_path is None:
                raise MigrationRefused("a file source needs --out (the input is never changed)")
            if self._out_path.resolve() == self._path.resolve():
                raise MigrationRefused("--out must not be the input file")
        self._in: BinaryIO | None = None
        self._out: BinaryIO | None = None
        self._in_offset = 0
        self._out_offset = 0
        self._number = 0  # records read so far (the row id of files)
        self._prologue = b""  # what goes before the first record (a CSV header)

    def identity(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self._path.resolve()),
            "size": self._stat[0],
            "mtime_ns": self._stat[1],
            "field": self._field,
            "aad_field": self._aad_field,
            "out": None if self._out_path is None else str(self._out_path.resolve()),
        }

    # -- the format's part --------------------------------------------------------------------

    def _begin(self, handle: BinaryIO, fresh: bool) -> bytes:
        """Read what precedes the records (a CSV header); return the bytes to write first."""
        return b""

    def _records(self, handle: BinaryIO) -> Iterator[_Record]:
        raise NotImplementedError

    def _replace(self, record: _Record, new: str) -> bytes:
        raise NotImplementedError

    # -- the Source interface -----------------------------------------------------------------

    def start(self, position: Any | None) -> int | None:
        handle = open(self._path, "rb")  # noqa: SIM115 (kept open for the whole run)
        self._in = handle
        prologue = self._begin(handle, position is None)
        if position is not None:
            self._in_offset = int(position["in"])
            self._out_offset = int(position["out"])
            self._number = int(position["records"])
            handle.seek(self._in_offset)
        else:
            self._in_offset = handle.tell()
        remaining = _count_lines(handle)
        self._iter = self._records(handle)
        if self._dry_run or self._out_path is None:
            return remaining
        if position is None:
            if self._out_path.exists() and self._out_path.stat().st_size > 0:
                raise MigrationRefused(
                    f"{self._out_path} exists; remove it, or resume with the --checkpoint "
                    "of the run that wrote it"
                )
            self._out = open(self._out_path, "wb")  # noqa: SIM115
            self._out_offset = 0
        else:
            try:
                out = open(self._out_path, "r+b")  # noqa: SIM115
            except FileNotFoundError:
                raise MigrationRefused(
                    f"{self._out_path} is missing: the checkpoint says {self._out_offset} bytes "
                    "were written there"
                ) from None
            size = out.seek(0, os.SEEK_END)
            if size < self._out_offset:
                out.close()
                raise MigrationRefused(
                    f"{self._out_path} holds {size} bytes, fewer than the {self._out_offset} "
                    "its checkpoint counts: it was changed, so the run cannot resume safely"
                )
            out.truncate(self._out_offset)
            out.seek(self._out_offset)
            self._out = out
        # The header goes out with the first write, so that nothing is in the output before
        # the first checkpoint that counts it.
        self._prologue = prologue if self._out_offset == 0 else b""
        return remaining

    def position(self) -> Any:
        return {"in": self._in_offset, "out": self._out_offset, "records": self._number}

    def read(self, limit: int) -> Page | None:
        records: list[_Record] = []
        ids: list[Any] = []
        tokens: list[str | None] = []
        aads: list[bytes | None] = []
        failures: dict[int, tuple[str, str]] = {}
        for record in self._iter:
            records.append(record)
            if record.row is not None:
                number, token, aad, failure = record.row
                record.index = len(ids)
                if failure is not None:
                    failures[record.index] = failure
                ids.append(number)
                tokens.append(token)
                aads.append(aad)
                if len(ids) >= limit:
                    break
        if not records:
            return None
        self._in_offset += sum(len(r.raw) for r in records)
        end = {"in": self._in_offset, "out": None, "records": self._number}
        with_aad = self._aad_field is not None
        return Page(ids, tokens, aads if with_aad else None, end, failures, records)

    def write(self, group: Sequence[tuple[Page, Changes]], written: Written) -> None:
        parts: list[bytes] = []
        for page, changes in group:
            records: list[_Record] = page.extra
            new = dict(changes)
            parts += [
                self._replace(record, new[record.index]) if record.index in new else record.raw
                for record in records
            ]
        data = self._prologue + b"".join(parts)
        self._prologue = b""
        out = self._out
        assert out is not None
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
        self._out_offset += len(data)
        group[-1][0].end["out"] = self._out_offset
        written([], None)

    def landed(self, witness: Any) -> bool:
        return True

    def close(self) -> None:
        for handle in (self._in, self._out):
            if handle is not None:
                handle.close()
        self._in = self._out = None

    # -- shared by both formats -------------------------------------------------------------

    def _row(self, value: Any, aad: Any) -> _Row:
        self._number += 1
        token, failure = _text(value)
        return self._number, token, _aad(aad), failure

    def _bad(self, message: str) -> _Row:
        self._number += 1
        return self._number, None, None, (FAIL_BAD_RECORD, message)


class JsonlSource(_FileSource):
    """One JSON object per line; ``field`` names the token's member (top level)."""

    kind = "jsonl"

    def _records(self, handle: BinaryIO) -> Iterator[_Record]:
        for raw in handle:
            if not raw.strip():
                yield _Record(raw)
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                try:  # orjson refuses integers beyond 64 bits; the standard library does not
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
            if not isinstance(obj, dict):
                yield _Record(raw, None, self._bad("the line is not a JSON object"))
                continue
            aad = obj.get(self._aad_field) if self._aad_field is not None else None
            yield _Record(raw, obj, self._row(obj.get(self._field), aad))

    def _replace(self, record: _Record, new: str) -> bytes:
        obj, row = record.parsed, record.row
        assert row is not None
        assert row[1] is not None
        old = b'"' + row[1].encode("ascii") + b'"'
        if record.raw.count(old) == 1:
            return record.raw.replace(old, b'"' + new.encode("ascii") + b'"')
        obj[self._field] = new
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8") + (_line_ending(record.raw) or b"\n")


class CsvSource(_FileSource):
    """A CSV file with a header row; ``field`` names the token's column."""

    kind = "csv"

    def __init__(self, *args: Any, delimiter: str = ",", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delimiter = delimiter
        self._pending: list[bytes] = []
        self._column = -1
        self._aad_column = -1

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "delimiter": self._delimiter}

    def _lines(self, handle: BinaryIO) -> Iterator[str]:
        for raw in handle:
            self._pending.append(raw)
            yield raw.decode("utf-8", errors="surrogateescape")

    def _take(self) -> bytes:
        raw = b"".join(self._pending)
        self._pending.clear()
        return raw

    def _begin(self, handle: BinaryIO, fresh: bool) -> bytes:
        reader = csv.reader(self._lines(handle), delimiter=self._delimiter)
        try:
            header = next(reader)
        except (StopIteration, csv.Error):
            raise MigrationRefused(f"{self._path} has no CSV header row") from None
        raw = self._take()
        if header and header[0].startswith("\ufeff"):
            header[0] = header[0][1:]
        for name, attr in ((self._field, "_column"), (self._aad_field, "_aad_column")):
            if name is None:
                continue
            if name not in header:
                raise MigrationRefused(
                    f"{self._path} has no column {name!r}; its header is: {', '.join(header)}"
                )
            setattr(self, attr, header.index(name))
        return raw

    def _records(self, handle: BinaryIO) -> Iterator[_Record]:
        self._pending.clear()
        reader = csv.reader(self._lines(handle), delimiter=self._delimiter)
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                yield _Record(self._take(), None, self._bad(f"CSV error: {exc}"))
                continue
            raw = self._take()
            if not fields:
                yield _Record(raw)
                continue
            if len(fields) <= max(self._column, self._aad_column):
                yield _Record(raw, None, self._bad("the record has too few fields"))
                continue
            value = fields[self._column]
            aad = fields[self._aad_column] if self._aad_column >= 0 else None
            yield _Record(raw, fields, self._row(value or None, aad))
        if self._pending:
            yield _Record(self._take())

    def _replace(self, record: _Record, new: str) -> bytes:
        fields, row = record.parsed, record.row
        assert row is not None
        assert row[1] is not None
        old = row[1].encode("ascii")
        if record.raw.count(old) == 1:
            return record.raw.replace(old, new.encode("ascii"))
        fields[self._column] = new
        buffer = io.StringIO()
        ending = _line_ending(record.raw).decode() or "\r\n"
        csv.writer(buffer, delimiter=self._delimiter, lineterminator=ending).writerow(fields)
        return buffer.getvalue().encode("utf-8", errors="surrogateescape")
