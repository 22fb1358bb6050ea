"""Schemathesis hooks: sign every /v1/ request the way a client must (RFC 9421), through
schemathesis's documented auth hook (a ``requests`` auth object sees the final method, path,
query and body bytes). The credential comes from ``CRYPTD_CREDENTIAL`` (a client.json)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import requests
import schemathesis

from cryptd_client import sign_request

_CREDENTIAL = json.loads(Path(os.environ["CRYPTD_CREDENTIAL"]).read_text(encoding="utf-8"))
_CLIENT_ID = _CREDENTIAL["client_id"]
_SECRET = base64.b64decode(_CREDENTIAL["secret"])


class Rfc9421Auth(requests.auth.AuthBase):
    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        path, _, query = (request.path_url or "/").partition("?")
        if not path.startswith("/v1/"):
            return request
        body = request.body or b""
        if isinstance(body, str):
            body = body.encode("utf-8")
        if not isinstance(body, bytes):  # schemathesis sends whole bodies, never streams
            raise TypeError(f"cannot sign a streamed body ({type(body).__name__})")
        assert request.method is not None
        request.headers.update(sign_request(request.method, path, query, body, _CLIENT_ID, _SECRET))
        return request


# schemathesis attaches set_from_requests to the auth function at import, outside its type.
schemathesis.auth.set_from_requests(Rfc9421Auth())  # type: ignore[attr-defined]
