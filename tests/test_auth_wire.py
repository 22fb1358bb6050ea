"""Signature fields as they arrive on the wire, against a real server: repeated field lines
are combined by the edge and must still be refused as more than one signature."""

from __future__ import annotations

import base64

import orjson
import pytest

from service.auth.signature import sign_request
from tests.conftest import Server
from tests.rawhttp import exchange

pytestmark = pytest.mark.slow  # a live server

BODY = orjson.dumps({"plaintext": base64.b64encode(b"wire").decode()})
PATH = "/v1/encrypt/aes256-gcm"


def _send(server: Server, lines: list[tuple[str, str]]) -> tuple[int, object]:
    head = [f"POST {PATH} HTTP/1.1", "Host: cryptd", f"Content-Length: {len(BODY)}"]
    head += [f"{name}: {value}" for name, value in lines]
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + BODY
    (response,) = exchange(server.url, [raw])
    return response.status, response.json()


def _lines(server: Server, nonce: str) -> list[tuple[str, str]]:
    signed = sign_request("POST", PATH, "", BODY, server.client_id, server.secret, nonce=nonce)
    return list(signed.items())


@pytest.mark.parametrize("field", ["Signature-Input", "Signature"])
def test_a_second_signature_field_line_is_401(server: Server, field: str) -> None:
    bogus_source = dict(_lines(server, "bogus-" + field))
    bogus = (
        bogus_source["Signature-Input"]
        if field == "Signature-Input"
        else "sig1=:" + base64.b64encode(bytes(32)).decode() + ":"
    )
    valid = _lines(server, "valid-" + field)
    # The bogus line first, then the complete valid request: the last member must not win.
    status, body = _send(server, [(field, bogus), *valid])
    assert status == 401, body
    assert isinstance(body, dict)
    assert body["error"]["code"] == "unauthenticated"
    # A valid line repeated after itself is still two signatures.
    again = _lines(server, "again-" + field)
    status, _ = _send(server, [*again, (field, dict(again)[field])])
    assert status == 401
    # And the same request, sent once, is served.
    status, body = _send(server, _lines(server, "once-" + field))
    assert status == 200, body
