"""The sign body's parser: its shortcut for ``{"message": ...}`` alone gives what the model
gives, and every other body still goes through the model."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, cast

import pytest

from service.api.items import PARSERS
from service.crypto.base import NO_OPTIONS
from service.errors import InvalidRequest, SchemaError
from service.operations import SignItem

# The sign parser makes SignItems (PARSERS holds every operation's parser under one type).
parse = cast(Callable[[dict[str, Any]], SignItem], PARSERS["sign"])


@pytest.mark.parametrize("message", [b"", b"m", bytes(range(32)), bytes(1000)])
def test_message_alone_is_parsed_as_the_model_parses_it(message: bytes) -> None:
    text = base64.b64encode(message).decode()
    short = parse({"message": text})
    # A null field beside it is the same body to the model, which takes it (two fields).
    modelled = parse({"message": text, "key_version": None, "algorithm": None})
    assert short == modelled == SignItem(message, False, NO_OPTIONS, None)
    assert short.options is NO_OPTIONS
    assert modelled.options is NO_OPTIONS


@pytest.mark.parametrize("text", ["AA", "AA==\n", "-_8=", "A===", "aGk=aGk="])
def test_bad_base64_is_refused_alike_on_both_paths(text: str) -> None:
    answers = []
    for body in ({"message": text}, {"message": text, "key_version": None}):
        with pytest.raises(InvalidRequest) as caught:
            parse(body)
        answers.append(caught.value.message)
    assert answers[0] == answers[1] == "'message' is not valid base64 (RFC 4648, padded)"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"message": 5}, InvalidRequest),  # a wrong JSON type is 400
        ({"message": None}, InvalidRequest),  # neither message nor digest
        ({"message": "aGk=", "extra": 1}, SchemaError),  # an unknown field is 422
        ({"message": "aGk=", "digest": "aGk="}, InvalidRequest),
    ],
)
def test_other_bodies_still_meet_the_model(body: dict[str, object], error: type) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert type(caught.value) is error  # SchemaError (422) is an InvalidRequest (400) too


def test_an_option_sent_is_kept() -> None:
    item = parse({"message": "aGk=", "encoding": "raw", "key_version": 2})
    assert item.options is not NO_OPTIONS
    assert item.options.encoding == "raw"
    assert item.key_version == 2
    assert item.data == b"hi"
    assert not item.prehashed
    with pytest.raises(InvalidRequest, match="signer_id"):
        parse({"message": "aGk=", "signer_id": "x" * 256})
