"""The OpenAPI document: generated from service/api/spec.py, committed, complete and valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from openapi_spec_validator import validate
from starlette.routing import BaseRoute

from service.api import openapi, spec
from service.api.application import create_app
from service.api.errors import STATUS
from service.cli.serve import prepare_dev_dir
from service.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT = ROOT / "docs" / "openapi.json"


@pytest.fixture(scope="module")
def app_routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    directory = tmp_path_factory.mktemp("openapi")
    saved = dict(os.environ)
    try:
        prepare_dev_dir(directory / "dev", "http://127.0.0.1:8080")  # sets CRYPTD_* variables
        app = create_app(Settings(docs=True, audit_log="off"))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {
        (method, route.path)
        for route in _flatten(app.routes)
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods or ()
    }


def _flatten(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    """Routes, with those of included routers (FastAPI keeps them in a wrapper) inlined."""
    for route in routes:
        included = getattr(route, "original_router", None)
        yield from _flatten(included.routes) if included is not None else (route,)


def test_committed_document_is_the_generated_one() -> None:
    assert DOCUMENT.read_text(encoding="utf-8") == openapi.render(openapi.build_document()), (
        "docs/openapi.json is stale: run 'python -m service.api.openapi --write'"
    )


@pytest.mark.slow
def test_check_command_fails_on_a_stale_document(tmp_path: Path) -> None:
    stale = tmp_path / "openapi.json"
    stale.write_text("{}\n", encoding="utf-8")
    check = [sys.executable, "-m", "service.api.openapi", "--check", "--path"]
    assert subprocess.run([*check, str(stale)], cwd=ROOT, capture_output=True).returncode == 1
    assert subprocess.run([*check, str(DOCUMENT)], cwd=ROOT).returncode == 0


def test_document_is_valid_openapi_3_1() -> None:
    document = json.loads(DOCUMENT.read_text(encoding="utf-8"))
    assert document["openapi"] == "3.1.0"
    validate(document)


def test_every_route_is_declared_and_every_declaration_is_a_route(
    app_routes: set[tuple[str, str]],
) -> None:
    declared = {(route.method, route.path) for route in spec.ROUTES}
    assert app_routes == declared


def test_every_error_code_has_a_status_and_a_description() -> None:
    assert set(STATUS) | {"schema"} == set(spec.ERROR_CODES)
    for route in spec.ROUTES:
        assert set(route.codes) <= set(spec.ERROR_CODES), route.operation_id


def test_every_signed_operation_requires_the_signature_and_batches_are_declared() -> None:
    document = openapi.build_document()
    schemes = document["components"]["securitySchemes"]
    assert {s["name"] for s in schemes.values()} == {
        "Signature",
        "Signature-Input",
        "Content-Digest",
    }
    assert "stH31tVkXcP68lL6vDwKcynKuh5ojw2S9Fb43vySHfM=" in schemes["Signature"]["description"]
    for route in spec.ROUTES:
        operation = document["paths"][route.path][route.method.lower()]
        if route.signed:
            assert operation["security"] == [{key: [] for key in openapi.SECURITY_SCHEMES}]
            assert {"401", "413", "429", "500", "503"} <= operation["responses"].keys()
        else:
            assert operation["security"] == []
        body = operation.get("requestBody", {}).get("content", {}).get("application/json")
        if route.batch:
            refs = [s["$ref"] for s in body["schema"]["oneOf"]]
            assert refs[1].endswith("Batch")
            batch = document["components"]["schemas"][refs[1].rsplit("/", 1)[1]]
            assert batch["properties"]["batch"]["minItems"] == 1


def test_schemas_are_as_strict_as_the_service() -> None:
    schemas = openapi.build_document()["components"]["schemas"]
    assert schemas["UpdateKeyRequest"]["not"]  # PATCH {} is refused
    assert schemas["UpdateKeyRequest"]["additionalProperties"] is False
    assert "" not in schemas["CreateKeyRequest"]["properties"]["type"]["enum"]
    assert schemas["DatakeyRequest"]["properties"]["bits"]["enum"] == [128, 256]
    assert len(schemas["SignRequest"]["not"]["anyOf"]) == 2  # message xor digest


def test_every_success_answer_with_a_body_declares_its_schema() -> None:
    # An outside client generator needs the body of each 2xx: a 204 alone has none.
    document = json.loads(DOCUMENT.read_text(encoding="utf-8"))
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, answer in operation["responses"].items():
                if not status.startswith("2") or status == "204":
                    continue
                content = answer.get("content", {})
                assert content, f"{method.upper()} {path} {status}: no content"
                for media, body in content.items():
                    assert body.get("schema"), f"{method.upper()} {path} {status} {media}"
