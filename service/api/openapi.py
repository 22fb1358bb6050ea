"""The OpenAPI 3.1 document, built from the declaration in :mod:`service.api.spec` alone.

    python -m service.api.openapi --write    # regenerate docs/openapi.json
    python -m service.api.openapi --check    # exit 1 when docs/openapi.json differs

FastAPI's own generator is not used: the crypto routes read their raw body (one code path for
single items and batches), so FastAPI knows neither their bodies nor their answers, and it
would declare a 422 shape the service never sends.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service import __version__
from service.api.errors import STATUS
from service.api.schemas import KEY_NAME_PATTERN
from service.api.spec import ERROR_CODES, ROUTES, Route
from service.auth.signature import CONTENT_TYPE, COVERED_COMPONENTS

DOCUMENT_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
_REF = "#/components/schemas/{model}"
_SCHEMA_STATUS = 422  # the "schema" pseudo-code: a missing or unknown field

SECURITY_SCHEMES = ("Signature", "SignatureInput", "ContentDigest")

# The known-answer vector of docs/AUTH.md (tests/vectors/request_signature.json).
_EXAMPLE = {
    "request": 'POST /v1/encrypt/orders, body {"plaintext":"aGVsbG8gd29ybGQ="}',
    "secret": "tKtlcrbpPWE/g55NZEzpcmn5vPIer40d8LoQ9x7BR14=",
    "keyid": "billing",
    "created": 1767225600,
    "nonce": "E7zF1Eme3Bi9KdgXtME_Mg",
    "content_digest": "sha-256=:94eAsvH/2QofB45X76r4hBJjeSvuJl7rivOgGXAY5Lk=:",
    "signature": "sig1=:stH31tVkXcP68lL6vDwKcynKuh5ojw2S9Fb43vySHfM=:",
}
_COVERED = " ".join(f'"{c}"' for c in COVERED_COMPONENTS)
_SIGNATURE_INPUT_EXAMPLE = (
    f'sig1=({_COVERED});created={_EXAMPLE["created"]};nonce="{_EXAMPLE["nonce"]}"'
    f';keyid="{_EXAMPLE["keyid"]}";alg="hmac-sha256"'
)

_SIGNING = f"""Every `/v1/` request is signed with HTTP Message Signatures (RFC 9421), algorithm
`hmac-sha256`, keyed with the client secret's base64-decoded bytes. OpenAPI has no scheme for
HTTP message signatures, so the three headers a signed request carries are declared as
`apiKey` header schemes that are all required together; none of them is a static key: every
request computes them afresh.

- `Content-Digest` (RFC 9530): `sha-256=:<base64 SHA-256 of the body>:`, also for an empty
  body (`sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:`).
- `Signature-Input`: `sig1=({_COVERED});created=<unix seconds>;nonce="<fresh random>";
  keyid="<client id>";alg="hmac-sha256"` -- exactly these covered components, in this order.
- `Signature`: `sig1=:<base64 HMAC-SHA256(secret, signature base)>:`.

The signature base is one line per covered component and the parameters line, joined by
`\\n` without a trailing newline:

```
"@method": POST
"@path": /v1/encrypt/orders
"@query": ?
"content-digest": sha-256=:<base64>:
"content-type": {CONTENT_TYPE}
"@signature-params": ({_COVERED});created=...;nonce="...";keyid="...";alg="hmac-sha256"
```

`@path` is the path as sent (percent-encoded), `@query` is `?` and the query as sent.
Every signed request carries `Content-Type: {CONTENT_TYPE}`. `created` must be within the
accepted clock skew (300 s by default); a `(keyid, nonce)` pair is accepted once.

Known answer: secret `{_EXAMPLE["secret"]}` (base64), keyid `{_EXAMPLE["keyid"]}`,
{_EXAMPLE["request"]}, created `{_EXAMPLE["created"]}`, nonce `{_EXAMPLE["nonce"]}` give
`Content-Digest: {_EXAMPLE["content_digest"]}`,
`Signature-Input: {_SIGNATURE_INPUT_EXAMPLE}` and `Signature: {_EXAMPLE["signature"]}`.
docs/AUTH.md gives the whole recipe and the signature base of this example."""

_SCHEME_TEXT = {
    "Signature": ("Signature", _SIGNING),
    "SignatureInput": (
        "Signature-Input",
        f"RFC 9421 signature parameters, e.g. `{_SIGNATURE_INPUT_EXAMPLE}` "
        "(see the Signature scheme).",
    ),
    "ContentDigest": (
        "Content-Digest",
        f"RFC 9530 digest of the body, e.g. `{_EXAMPLE['content_digest']}` "
        "(see the Signature scheme).",
    ),
}


def _schemas(routes: Iterable[Route]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(components.schemas, model name -> $ref) for every model the routes use."""
    models: dict[str, type[BaseModel]] = {}
    for route in routes:
        for model in (route.request, *route.answers.values()):
            if model is not None:
                models[model.__name__] = model
    from service.api.responses import Error

    models[Error.__name__] = Error
    ordered = [models[name] for name in sorted(models)]
    _, top = models_json_schema([(m, "validation") for m in ordered], ref_template=_REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["ErrorDetail"]["properties"]["code"]["enum"] = sorted(
        {code for code in ERROR_CODES if code != "schema"}
    )
    return schemas, {name: {"$ref": _REF.format(model=name)} for name in models}


def _batch_schemas(route: Route, schemas: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request and answer schemas of a route with batch forms, components added."""
    assert route.request is not None
    request_name = route.request.__name__
    answer = route.answers[200]
    assert answer is not None
    answer_name = answer.__name__
    batch_request = f"{request_name}Batch"
    batch_answer = f"{answer_name}Batch"
    schemas[batch_request] = {
        "title": batch_request,
        "type": "object",
        "description": "Items are processed in order; an item that is not a valid "
        f"{request_name} gets its own error entry in the answer, never failing the others.",
        "properties": {
            "batch": {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": [{"$ref": _REF.format(model=request_name)}, {}]},
                "description": "At least one item; more than the item limit (1,000 by "
                "default) is 413, and so is more than the key type's batch limit: what one "
                "core finishes within half the 5 s deadline (500 for RSA-4096 decrypt and "
                "sign by default; the 413 message names the limit).",
            }
        },
        "required": ["batch"],
        "additionalProperties": False,
    }
    schemas[batch_answer] = {
        "title": batch_answer,
        "type": "object",
        "description": "One entry per request item, in the same order.",
        "properties": {
            "batch": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "oneOf": [
                        {"$ref": _REF.format(model=answer_name)},
                        {"$ref": _REF.format(model="Error")},
                    ]
                },
            }
        },
        "required": ["batch"],
        "additionalProperties": False,
    }
    request = {
        "oneOf": [
            {"$ref": _REF.format(model=request_name)},
            {"$ref": _REF.format(model=batch_request)},
        ]
    }
    response = {
        "oneOf": [
            {"$ref": _REF.format(model=answer_name)},
            {"$ref": _REF.format(model=batch_answer)},
        ]
    }
    return request, response


def _status_of(code: str) -> int:
    return _SCHEMA_STATUS if code == "schema" else STATUS[code]


def _error_responses(route: Route) -> dict[str, Any]:
    by_status: dict[int, list[str]] = {}
    for code in route.codes:
        by_status.setdefault(_status_of(code), []).append(code)
    out: dict[str, Any] = {}
    for status in sorted(by_status):
        codes = by_status[status]
        lines = [
            f"- `{'invalid_request' if c == 'schema' else c}`: {ERROR_CODES[c]}" for c in codes
        ]
        response: dict[str, Any] = {
            "description": "\n".join(lines),
            "headers": {"X-Request-ID": {"$ref": "#/components/headers/X-Request-ID"}},
            "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}},
        }
        if status in (429, 503):
            response["headers"]["Retry-After"] = {
                "$ref": "#/components/headers/Retry-After"
                if status == 429
                else "#/components/headers/Retry-After-Optional"
            }
        out[str(status)] = response
    return out


def _operation(route: Route, schemas: dict[str, Any], refs: dict[str, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "tags": [route.tag],
    }
    if route.description:
        operation["description"] = route.description
    if "{key}" in route.path:
        operation["parameters"] = [{"$ref": "#/components/parameters/key"}]
    if "{approval_id}" in route.path:
        operation["parameters"] = [{"$ref": "#/components/parameters/approval_id"}]
    request_schema = answer_schema = None
    if route.batch:
        request_schema, answer_schema = _batch_schemas(route, schemas)
    elif route.request is not None:
        request_schema = refs[route.request.__name__]
    if request_schema is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {CONTENT_TYPE: {"schema": request_schema}},
        }
    responses: dict[str, Any] = {}
    for status, model in route.answers.items():
        response: dict[str, Any] = {
            "description": "OK" if status < 300 else "Not ready",
            "headers": {"X-Request-ID": {"$ref": "#/components/headers/X-Request-ID"}},
        }
        if model is not None:
            schema = answer_schema if route.batch and status == 200 else refs[model.__name__]
            response["content"] = {route.media_type: {"schema": schema}}
        elif route.media_type != CONTENT_TYPE:
            response["content"] = {route.media_type: {"schema": {"type": "string"}}}
        else:
            response["description"] = "Done (no body)"
        responses[str(status)] = response
    responses.update(_error_responses(route))
    operation["responses"] = dict(sorted(responses.items()))
    operation["security"] = [{name: [] for name in SECURITY_SCHEMES}] if route.signed else []
    return operation


def build_document() -> dict[str, Any]:
    """The whole document (deterministic: the same bytes for the same declaration)."""
    schemas, refs = _schemas(ROUTES)
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schemas, refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "cryptd",
            "version": __version__,
            "summary": "Encryption as a service: keys stay inside, operations come in over REST.",
            "description": "JSON in and out; binary fields are standard padded base64. "
            "Every `/v1/` request is signed (see the Signature security scheme). Errors have "
            'one shape: `{"error": {"code", "message"}}`. Every response carries '
            "`X-Request-ID` (echoed when the request sent a sane one). A known route called "
            "with another method answers 405 `method_not_allowed` with `Allow`; every GET "
            "operation also answers HEAD (the same status and header fields, no body; a "
            "signed HEAD is signed with `@method` HEAD); an unknown "
            "route 404 `not_found`; a body that is not `application/json` may be refused.",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "parameters": {
                "key": {
                    "name": "key",
                    "in": "path",
                    "required": True,
                    "description": "Key name: [A-Za-z0-9_.-]{1,128}, not '.' or '..' "
                    "(anything else is 400 invalid_request).",
                    "schema": {
                        "type": "string",
                        "pattern": KEY_NAME_PATTERN,
                        "not": {"enum": [".", ".."]},
                    },
                },
                "approval_id": {
                    "name": "approval_id",
                    "in": "path",
                    "required": True,
                    "description": "An approval's id, as the 202 gave it (anything else is 400 "
                    "invalid_request).",
                    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                },
            },
            "headers": {
                "X-Request-ID": {
                    "description": "The request's id: the one the client sent, if sane, "
                    "else a fresh one.",
                    "required": True,
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
                },
                "Retry-After": {
                    "description": "Seconds to wait before retrying (at least 1).",
                    "required": True,
                    "schema": {"type": "string", "pattern": "^[1-9][0-9]*$"},
                },
                "Retry-After-Optional": {
                    "description": "Seconds to wait before retrying (at least 1), where the "
                    "refusal is temporary (overloaded).",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[1-9][0-9]*$"},
                },
            },
            "securitySchemes": {
                name: {"type": "apiKey", "in": "header", "name": header, "description": text}
                for name, (header, text) in _SCHEME_TEXT.items()
            },
        },
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.api.openapi", description=__doc__)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="write docs/openapi.json")
    action.add_argument("--check", action="store_true", help="exit 1 if it differs")
    parser.add_argument("--path", type=Path, default=DOCUMENT_PATH)
    args = parser.parse_args(argv)
    text = render(build_document())
    if args.write:
        args.path.write_text(text, encoding="utf-8")
        return 0
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != text:
            print(
                f"{args.path} is not the generated document: run "
                "'python -m service.api.openapi --write' and commit it",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
