"""The encrypt and decrypt bodies taken without building their models give what the models give:
the same items, and for anything else the same errors (pydantic still answers those)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import BaseModel

from service.api import items, schemas
from service.errors import CryptdError
from service.operations import DecryptItem, EncryptItem

VALUES: list[Any] = ["AQID", "", "not base64!", 1, 2.0, 1.5, True, None, [], {}, 0, -3]


def _through_the_model(op: str, data: dict[str, Any]) -> EncryptItem | DecryptItem:
    """The conversion as it is written for any body: validate the model, then convert."""
    if op == "encrypt":
        body = schemas.validate(schemas.EncryptRequest, data)
        return EncryptItem(
            schemas.decode_b64(body.plaintext, "plaintext"),
            items._aad(body.aad),
            body.key_version,
            items._context(body.context),
        )
    decrypt = schemas.validate(schemas.DecryptRequest, data)
    return DecryptItem(
        decrypt.ciphertext,
        items._aad(decrypt.aad),
        decrypt.format,
        decrypt.key_version,
        items._context(decrypt.context),
    )


def _outcome(function: Any, *args: Any) -> object:
    try:
        return function(*args)
    except CryptdError as exc:
        return (type(exc), exc.code, exc.message)


@pytest.mark.parametrize(
    ("model", "fields", "required"),
    [
        (schemas.EncryptRequest, items.ENCRYPT_FIELDS, "plaintext"),
        (schemas.DecryptRequest, items.DECRYPT_FIELDS, "ciphertext"),
    ],
)
def test_the_tables_name_the_models_fields(
    model: type[BaseModel], fields: dict[str, tuple[type, ...]], required: str
) -> None:
    assert set(fields) == set(model.model_fields)
    assert [n for n, f in model.model_fields.items() if f.is_required()] == [required]
    for info in model.model_fields.values():  # no validator the tables would skip
        # (the versions' BeforeValidator turns 2.0 into 2: a float goes through the model)
        assert all(type(m).__name__ == "BeforeValidator" for m in info.metadata)


@pytest.mark.parametrize("op", ["encrypt", "decrypt"])
def test_bodies_give_the_models_items_and_errors(op: str) -> None:
    parse = items.PARSERS[op]  # type: ignore[index]
    fields = list(items.ENCRYPT_FIELDS if op == "encrypt" else items.DECRYPT_FIELDS)
    required = fields[0]
    documents: list[dict[str, Any]] = [{}, {"unknown": "x"}, {required: "AQID", "unknown": 1}]
    for name in fields:
        for value in VALUES:
            documents.append({required: "AQID", name: value})
    for first, second in itertools.combinations(fields, 2):
        documents.append({required: "AQID", first: "AQID", second: None})
        documents.append({first: 1, second: "AQID"})
    taken = 0
    for document in documents:
        expected = _outcome(_through_the_model, op, document)
        assert _outcome(parse, document) == expected, document
        taken += not isinstance(expected, tuple)
    assert taken > len(fields)  # valid bodies were among them, not only refusals
