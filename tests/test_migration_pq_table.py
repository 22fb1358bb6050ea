"""docs/MIGRATION.md's post-quantum trade-offs are the bench's figures: every size in its tables
is what :func:`loadtest.algorithms.pq.sizes` (the sizes ``cryptd bench`` reports) measures now,
and its speed ratios agree with the rates printed beside them. No timing is measured here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from loadtest.algorithms import pq

DOC = Path(__file__).resolve().parents[1] / "docs" / "MIGRATION.md"
_ROW = re.compile(r"^\| (.+) \|$", re.M)
_NUMBER = re.compile(r"[0-9][0-9,]*")


@pytest.fixture(scope="module")
def sizes() -> dict[str, dict[str, Any]]:
    return pq.sizes()


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("### Post-quantum trade-offs")
    return text[start : text.index("\n## ", start)]


def _tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table of ``text``: its rows (header first, the rule left out) of cells."""
    tables: list[list[list[str]]] = []
    for block in re.split(r"\n(?!\|)", text):
        rows = [m[1].split(" | ") for m in _ROW.finditer(block)]
        if rows:
            tables.append([r for r in rows if not set("".join(r)) <= set("-:")])
    return tables


def _table(text: str, first_header: str, header_word: str) -> list[list[str]]:
    found = [t for t in _tables(text) if t[0][0] == first_header and header_word in t[0][1]]
    assert len(found) == 1, (first_header, header_word)
    return found[0]


def _int(cell: str) -> int:
    match = _NUMBER.search(cell)
    assert match, cell
    return int(match[0].replace(",", ""))


def _key_type(cell: str) -> str:
    match = re.match(r"`([a-z0-9-]+)`", cell)
    assert match, cell
    return match[1]


def _public_key(cell: str, measured: dict[str, Any]) -> None:
    if "raw" in cell:
        assert _int(cell) == measured["public_key_raw"], cell
    else:
        assert "SPKI DER" in cell or cell.replace(",", "").isdigit(), cell
        assert _int(cell) == measured["public_key"], cell


def test_the_token_table_is_the_bench_sizes(sizes: dict[str, dict[str, Any]]) -> None:
    table = _table(_section(), "key type", "token")
    assert len(table) > 1
    listed = set()
    for cells in table[1:]:
        name = _key_type(cells[0])
        listed.add(name)
        assert name in pq.ENCRYPTING, name
        token, body, overhead, public = cells[1:]
        assert _int(token) == sizes[name]["token"], name
        assert _int(body) == sizes[name]["ciphertext"], name
        assert _int(overhead) == sizes[name]["ciphertext"] - pq.DATA_KEY_BYTES, name
        _public_key(public, sizes[name])
    assert listed == set(pq.ENCRYPTING)
    sentence = r"An X-Wing token is ([0-9,]+) characters longer than an RSA-2048"
    longer = re.search(sentence, _section())
    assert longer, "the X-Wing / RSA-2048 sentence"
    assert _int(longer[1]) == sizes["x25519-ml-kem-768"]["token"] - sizes["rsa-2048"]["token"]


def test_the_signature_table_is_the_bench_sizes(sizes: dict[str, dict[str, Any]]) -> None:
    table = _table(_section(), "key type", "signature")
    listed = set()
    for cells in table[1:]:
        name = _key_type(cells[0])
        listed.add(name)
        assert name in pq.SIGNING, name
        signature, public = cells[1:]
        measured = sizes[name]["signature"]
        span = re.match(r"([0-9,]+)-([0-9,]+) \(DER", signature)
        if span:
            # DER drops a leading zero byte of r or s: a signature a byte or two shorter than
            # the range comes once in a few hundred, never a longer one.
            low, high = _int(span[1]), _int(span[2])
            assert low - 3 <= measured <= high, (name, measured)
        else:
            assert _int(signature) == measured, name
        _public_key(public, sizes[name])
    assert listed == set(pq.SIGNING)


def test_the_speed_ratios_agree_with_the_rates_beside_them() -> None:
    """Each ratio column is the quotient of two rate columns of its table, as printed."""
    tables = [t for t in _tables(_section()) if t[0][0] == "operation"]
    assert len(tables) == 2
    checked = 0
    for table in tables:
        header = table[0]
        for cells in table[1:]:
            pairs = list(zip(header[1:], cells[1:], strict=True))
            rates = {h: _int(c) for h, c in pairs if "/" not in h}
            for column, cell in pairs:
                if "/" not in column:
                    continue
                over, _, under = column.partition(" / ")
                expected = rates[over] / rates[under]
                assert float(cell) == pytest.approx(expected, rel=0.05, abs=0.01), (column, cells)
                checked += 1
    assert checked >= 8
