"""The migration tool's pure parts: what a token's header says, ids in checkpoints, the
verification sampler, the counts."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest

from service.migrate.checkpoint import CheckpointFile, Snapshot, State
from service.migrate.ids import decode_id, encode_id
from service.migrate.model import Counts, MigrationRefused, Outcome
from service.migrate.sampling import Sampler
from service.migrate.tokens import type_id

# docs/FORMAT.md section 5: AES-256-GCM (type id 1) and SM4-GCM (type id 2) vectors.
AES_VECTOR = "cryptd:v1:AQHK_rq--s7brd7K-IjCxsxKxVZveDRyLakfPJ1l6X8yo3_qnYDO1EgB4nM"
SM4_VECTOR = "cryptd:v2:AQIAABI0VngAAAAAq83uFAd3YY4yZNYEDEe8X3aj8GzMbTMsacachTl_uu5cV7q4g94"


def test_type_ids_of_the_format_vectors() -> None:
    assert type_id(AES_VECTOR) == 1
    assert type_id(SM4_VECTOR) == 2


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("hello", "not_a_token"),
        ("", "not_a_token"),
        ("vault:v1:abcd", "not_a_token"),
        ("cryptd:v1:AQ", "damaged_token"),  # too short for a header
        ("cryptd:v1:AgHK" + AES_VECTOR[14:], "damaged_token"),  # format byte 2
        ("cryptd:v0:" + AES_VECTOR[10:], "damaged_token"),  # version 0
        ("cryptd:v01:" + AES_VECTOR[10:], "damaged_token"),  # leading zero
        ("cryptd:v1:AQ+K" + AES_VECTOR[14:], "damaged_token"),  # standard alphabet
    ],
)
def test_what_is_no_token(text: str, reason: str) -> None:
    result = type_id(text)
    assert isinstance(result, tuple)
    assert result[0] == reason


def test_ids_keep_their_type_through_json() -> None:
    values = [
        7,
        -(2**70),
        "abc",
        b"\x00\xff",
        uuid.uuid4(),
        decimal.Decimal("12.50"),
        datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        datetime.date(2026, 1, 2),
        None,
    ]
    for value in values:
        back = decode_id(json.loads(json.dumps(encode_id(value))))
        assert back == value
        assert type(back) is type(value)
    with pytest.raises(MigrationRefused, match="cannot be saved in a checkpoint"):
        encode_id(object())


def test_sampler_spreads_exactly_n_over_migrated_rows() -> None:
    sampler = Sampler(50, 1000)
    picked: list[int] = []
    for page in range(10):
        picked += [page * 100 + i for i in sampler.pick(list(range(100)), 100)]
    assert len(picked) == 50
    assert len(set(picked)) == 50
    assert min(picked) < 300
    assert max(picked) > 700  # spread, not the first fifty


def test_sampler_never_picks_a_row_that_did_not_migrate() -> None:
    sampler = Sampler(100, 200)
    chosen = sampler.pick([1, 3, 5], 200)
    assert set(chosen) <= {1, 3, 5}
    assert Sampler(0, 10).pick(list(range(10)), 10) == []


def test_counts_round_trip_and_tally() -> None:
    counts = Counts()
    counts.add(
        [
            Outcome.migrated("cryptd:v1:x"),
            Outcome.skipped("null"),
            Outcome.failed("decryption_failed", "m"),
            Outcome.failed("decryption_failed", "m"),
        ]
    )
    assert counts.rows == 4
    assert counts.failed == Counter({"decryption_failed": 2})
    again = Counts.from_json(json.loads(json.dumps(counts.to_json())))
    assert again.to_json() == counts.to_json()


def test_a_checkpoint_keeps_its_pass_and_older_ones_are_pass_one(tmp_path: Path) -> None:
    binding = {"source": {"kind": "sql"}, "from_key": "a", "to_key": "b"}
    checkpoint = CheckpointFile(tmp_path / "c.ckpt", binding)
    checkpoint.save(State(Snapshot({"after": 5, "nulls": 0}, Counts()), done=True, pass_number=3))
    loaded = checkpoint.load()
    assert loaded is not None
    assert (loaded.pass_number, loaded.done) == (3, True)

    document = json.loads(checkpoint.path.read_text())
    del document["pass"]  # written before passes existed
    checkpoint.path.write_text(json.dumps(document))
    loaded = checkpoint.load()
    assert loaded is not None
    assert loaded.pass_number == 1

    for bad in (0, -1, "two"):
        document["pass"] = bad
        checkpoint.path.write_text(json.dumps(document))
        with pytest.raises(MigrationRefused, match="not a migration checkpoint"):
            checkpoint.load()
