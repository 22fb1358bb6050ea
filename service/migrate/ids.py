"""Row ids as JSON (checkpoint positions, failure logs) and back, keeping their type."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

from .model import MigrationRefused


def encode_id(value: Any) -> Any:
    """A JSON value that :func:`decode_id` turns back into ``value`` (same type)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | str | float):
        return value
    if isinstance(value, bytes | memoryview):
        return {"hex": bytes(value).hex()}
    if isinstance(value, uuid.UUID):
        return {"uuid": str(value)}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    if isinstance(value, datetime.datetime):
        return {"datetime": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"date": value.isoformat()}
    raise MigrationRefused(
        f"id values of type {type(value).__name__} cannot be saved in a checkpoint; "
        "use an integer, text, bytes, UUID, decimal or date/time id column"
    )


def decode_id(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    ((tag, text),) = data.items()
    if tag == "hex":
        return bytes.fromhex(text)
    if tag == "uuid":
        return uuid.UUID(text)
    if tag == "decimal":
        return decimal.Decimal(text)
    if tag == "datetime":
        return datetime.datetime.fromisoformat(text)
    if tag == "date":
        return datetime.date.fromisoformat(text)
    raise ValueError(f"unknown id encoding {tag!r}")
