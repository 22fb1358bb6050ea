"""Every round of a ``loadtest.tls`` run, not only the medians: cryptd's throughput over
OpenBao's in each round, plain and over TLS, so a reader sees how far one round strays from
the median the tables give (the host's speed drifts within a run; docs/PERFORMANCE.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.scenarios import BY_NAME

Run = Mapping[str, Any]  # one measurement as the result's JSON holds it (Measurement.to_json)


def _ratio(ours: Run | None, theirs: Run | None) -> float | None:
    if ours is None or theirs is None or not theirs["ops"]:
        return None
    return float(ours["ops"] / theirs["ops"])


def _cell(values: Sequence[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values)


def _at(runs: Sequence[Run] | None, index: int) -> Run | None:
    return runs[index] if runs is not None and index < len(runs) else None


def rounds_table(runs: Mapping[str, Mapping[str, Sequence[Run]]], rounds: int) -> str:
    """One row per scenario: cryptd / OpenBao in round 1, 2, ... plain, then over TLS
    (``runs``: the result's ``runs``, by scenario and target label)."""
    rows = [
        "| scenario | ratio plain, round by round | ratio TLS, round by round |",
        "|---|---:|---:|",
    ]
    for name, by_label in runs.items():
        plain = [
            _ratio(_at(by_label.get("cryptd-plain"), i), _at(by_label.get("openbao-plain"), i))
            for i in range(rounds)
        ]
        tls = [
            _ratio(_at(by_label.get("cryptd-tls"), i), _at(by_label.get("openbao-tls"), i))
            for i in range(rounds)
        ]
        if all(v is None for v in plain + tls):
            continue
        rows.append(f"| {BY_NAME[name].title} | {_cell(plain)} | {_cell(tls)} |")
    return "\n".join(rows)
