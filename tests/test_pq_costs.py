"""``python -m loadtest.pq_costs`` runs (briefly) and reports the exact sizes docs/MIGRATION.md
quotes; the times it prints are not checked (never a timed unit test)."""

from __future__ import annotations

import re

import pytest

from loadtest import pq_costs


def test_sizes_match_the_migration_guide(capsys: pytest.CaptureFixture[str]) -> None:
    assert pq_costs.main(["--seconds", "0.001", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = {
        m[1]: m[2].split(" | ") for m in re.finditer(r"^\| `([a-z0-9-]+)` \| (.*) \|$", out, re.M)
    }
    # Encrypting types appear first, then signing types (rsa-2048 and sm2 in both tables).
    assert rows["x25519-ml-kem-768"][:3] == ["1,570", "1,168", "1,216 raw"]
    assert rows["ml-kem-768"][:3] == ["1,528", "1,136", "1,206"]
    assert rows["ml-kem-1024"][:3] == ["2,168", "1,616", "1,590"]
    assert rows["rsa-3072"][:3] == ["608", "446", "422"]
    assert rows["ml-dsa-65"][:2] == ["3,309", "1,974"]
    assert rows["ml-dsa-44"][:2] == ["2,420", "1,334"]
    assert rows["ml-dsa-87"][:2] == ["4,627", "2,614"]
    encryption = out.split("Signing")[0]
    assert "| `rsa-2048` | 437 | 318 | 294 |" in encryption
    assert "| `sm2` | 246 | 175 | 91 |" in encryption


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        pq_costs.main(["--seconds", "0"])
