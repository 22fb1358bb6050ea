"""Key states, min_encryption_version and deletion with a waiting period, through the API of a
real server, on the keyring file and on PostgreSQL: every state against every operation
(single, batch, rewrap from and to), PATCH's validation, DELETE's 202, cancel-deletion, the
destruction after the date (by the service's own scheduler) and the audit lines."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import responses
from tests.conftest import POSTGRES_DSN, Server, start_server, stop_server
from tests.test_keystore_support import wait_for

pytestmark = pytest.mark.slow  # live servers on the keyring file and on PostgreSQL

WAITING_PERIOD = 5  # seconds: CRYPTD_DELETION_WAITING_PERIOD of the servers here (long enough
# for the state matrix to finish with its keys pending, on a busy machine too)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@contextlib.contextmanager
def _database() -> Iterator[str]:
    """A database of this module's own on the shared PostgreSQL, dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    try:
        admin = psycopg.connect(POSTGRES_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required under CI: {exc}")
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is not reachable: {exc}")
    name = f"cryptd_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Service:
    """A server with a waiting period, and a way to look at what its store holds."""

    def __init__(self, server: Server, keystore_url: str | None) -> None:
        self.server = server
        self.keystore_url = keystore_url

    def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return self.server.request(method, path, body)

    def stored_keys(self) -> set[str]:
        if self.keystore_url is None:
            document = json.loads((self.server.directory / "dev" / "keyring.json").read_text())
            return set(document["keys"])
        import psycopg

        with psycopg.connect(self.keystore_url) as conn:
            return {row[0] for row in conn.execute("SELECT name FROM cryptd_keys")}

    def audit(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.server.log().splitlines():
            if '"cryptd.audit"' in line:
                with contextlib.suppress(ValueError):
                    lines.append(json.loads(line[line.index("{") :]))
        return lines


@pytest.fixture(scope="module", params=["file", "postgresql"])
def service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    env = {
        "CRYPTD_DELETION_WAITING_PERIOD": str(WAITING_PERIOD),
        "CRYPTD_AUTO_ROTATE_CHECK_INTERVAL": "0.2",
        # RSA in worker processes, which load the keyring themselves: states must reach them.
        "CRYPTD_EXECUTORS": '{"rsa-2048": "process"}',
    }
    with contextlib.ExitStack() as stack:
        url = None
        if request.param == "postgresql":
            url = stack.enter_context(_database())
            env["CRYPTD_KEYSTORE_URL"] = url
        server = start_server(tmp_path_factory.mktemp(f"states-{request.param}"), env)
        stack.callback(stop_server, server)
        yield Service(server, url)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def create(service: Service, key_type: str, **options: Any) -> str:
    name = unique(key_type)
    created = service.call("POST", f"/v1/keys/{name}", {"type": key_type, **options})
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "enabled"
    assert created.json()["min_encryption_version"] == 0
    assert "deletion_date" not in created.json()
    return name


def patch(service: Service, name: str, **fields: Any) -> dict[str, Any]:
    response = service.call("PATCH", f"/v1/keys/{name}", fields)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    return message


def set_state(service: Service, names: list[str], state: str) -> None:
    for name in names:
        if state == "pending_deletion":
            patch(service, name, deletion_allowed=True)
            scheduled = service.call("DELETE", f"/v1/keys/{name}")
            assert scheduled.status_code == 202, scheduled.text
        else:
            assert patch(service, name, state=state)["state"] == state


def restore(service: Service, names: list[str], state: str) -> None:
    for name in names:
        if state == "pending_deletion":
            restored = service.call("POST", f"/v1/keys/{name}/cancel-deletion")
            assert restored.status_code == 200, restored.text
        else:
            patch(service, name, state="enabled")


# Which operations each state allows ("rewrap_from": rewrap from the key to an enabled one;
# "rewrap_to": from an enabled key to it; "rewrap_self": under its own latest version).
ALLOWED = {
    "enabled": {
        "encrypt",
        "decrypt",
        "datakey",
        "sign",
        "verify",
        "hmac",
        "verify_mac",
        "rewrap_from",
        "rewrap_to",
        "rewrap_self",
    },
    "decrypt_only": {"decrypt", "verify", "verify_mac", "rewrap_from"},
    "disabled": set(),
    "pending_deletion": set(),
}


@pytest.mark.parametrize("state", list(ALLOWED))
def test_every_operation_against_every_state(service: Service, state: str) -> None:
    aes, rsa, signer, mac_key = (
        create(service, t) for t in ("aes256-gcm", "rsa-2048", "ecdsa-p256", "hmac-sha256")
    )
    other = create(service, "sm4-gcm")  # enabled throughout: the other end of rewraps
    message = b64(b"statement")
    aes_token = service.call("POST", f"/v1/encrypt/{aes}", {"plaintext": b64(b"a")}).json()
    rsa_token = service.call("POST", f"/v1/encrypt/{rsa}", {"plaintext": b64(b"r")}).json()
    other_token = service.call("POST", f"/v1/encrypt/{other}", {"plaintext": b64(b"o")}).json()
    signature = service.call("POST", f"/v1/sign/{signer}", {"message": message}).json()
    mac = service.call("POST", f"/v1/hmac/{mac_key}", {"message": message}).json()
    tested = [aes, rsa, signer, mac_key]
    set_state(service, tested, state)

    calls: dict[str, tuple[str, dict[str, Any], str]] = {
        "encrypt": (f"/v1/encrypt/{aes}", {"plaintext": b64(b"x")}, aes),
        "decrypt": (f"/v1/decrypt/{aes}", {"ciphertext": aes_token["ciphertext"]}, aes),
        "datakey": (f"/v1/datakey/{aes}", {}, aes),
        "sign": (f"/v1/sign/{signer}", {"message": message}, signer),
        "verify": (
            f"/v1/verify/{signer}",
            {"message": message, "signature": signature["signature"]},
            signer,
        ),
        "hmac": (f"/v1/hmac/{mac_key}", {"message": message}, mac_key),
        "verify_mac": (
            f"/v1/verify/{mac_key}",
            {"message": message, "mac": mac["mac"]},
            mac_key,
        ),
        # RSA runs in the pool: the state reaches the workers' keyrings too.
        "rewrap_from": (
            f"/v1/rewrap/{rsa}",
            {"ciphertext": rsa_token["ciphertext"], "to_key": other},
            rsa,
        ),
        "rewrap_to": (
            f"/v1/rewrap/{other}",
            {"ciphertext": other_token["ciphertext"], "to_key": aes},
            aes,
        ),
        "rewrap_self": (f"/v1/rewrap/{aes}", {"ciphertext": aes_token["ciphertext"]}, aes),
    }
    try:
        for operation, (path, body, refused_key) in calls.items():
            response = service.call("POST", path, body)
            if operation in ALLOWED[state]:
                assert response.status_code == 200, (operation, response.text)
                if operation.startswith("verify"):
                    assert response.json() == {"valid": True}
                continue
            text = error(response, 409, "key_disabled")
            assert f"key {refused_key!r} is {state}" in text, (operation, text)
            assert "refused" in text
        # Metadata stays readable in every state, and shows it.
        for name in tested:
            described = service.call("GET", f"/v1/keys/{name}")
            assert described.status_code == 200
            assert described.json()["state"] == state
            responses.KeyDescription.model_validate(described.json())
        every = service.call("GET", "/v1/keys").json()
        responses.KeyList.model_validate(every)
        listed = {k["name"]: k for k in every["keys"]}
        assert listed[aes]["state"] == state
    finally:
        restore(service, tested, state)
    # Back to enabled (PATCH or cancel-deletion): everything works again.
    assert service.call("POST", f"/v1/encrypt/{aes}", {"plaintext": b64(b"y")}).status_code == 200
    assert service.call("POST", f"/v1/sign/{signer}", {"message": message}).status_code == 200


def test_batches_report_the_state_as_the_contract_does(service: Service) -> None:
    source = create(service, "aes256-gcm")
    retired = create(service, "aes256-gcm")
    target = create(service, "sm4-gcm")
    tokens = [
        service.call("POST", f"/v1/encrypt/{source}", {"plaintext": b64(bytes([i]))}).json()
        for i in range(3)
    ]
    old = service.call("POST", f"/v1/encrypt/{retired}", {"plaintext": b64(b"old")}).json()
    patch(service, retired, state="decrypt_only")

    # The key the request names: its state concerns the whole request (as an unknown key).
    refused = service.call("POST", f"/v1/encrypt/{retired}", {"batch": [{"plaintext": ""}] * 2})
    assert "decrypt_only: encrypt is refused" in error(refused, 409, "key_disabled")
    opened = service.call(
        "POST", f"/v1/decrypt/{retired}", {"batch": [{"ciphertext": old["ciphertext"]}] * 2}
    )
    assert opened.status_code == 200
    assert [item["plaintext"] for item in opened.json()["batch"]] == [b64(b"old")] * 2

    # A rewrap target is named per item: a refused target fails its item alone.
    items = [
        {"ciphertext": tokens[0]["ciphertext"], "to_key": target},
        {"ciphertext": tokens[1]["ciphertext"], "to_key": retired},
        {"ciphertext": tokens[2]["ciphertext"]},
    ]
    answer = service.call("POST", f"/v1/rewrap/{source}", {"batch": items})
    assert answer.status_code == 200, answer.text
    first, second, third = answer.json()["batch"]
    assert first["ciphertext"].startswith("cryptd:v1:")
    assert second == {
        "error": {
            "code": "key_disabled",
            "message": f"key {retired!r} is decrypt_only: rewrap to it is refused",
        }
    }
    assert third["key_version"] == 1
    # The same from a key whose rewraps run in worker processes (RSA here): their keyrings
    # hold the states too.
    rsa = create(service, "rsa-2048")
    sealed = service.call("POST", f"/v1/encrypt/{rsa}", {"plaintext": b64(b"r")}).json()
    pooled = service.call(
        "POST",
        f"/v1/rewrap/{rsa}",
        {"batch": [{"ciphertext": sealed["ciphertext"], "to_key": k} for k in (retired, target)]},
    )
    refused_item, moved_item = pooled.json()["batch"]
    assert refused_item["error"]["code"] == "key_disabled"
    assert moved_item["key_version"] == 1
    # From the retired key to another: allowed, item by item.
    moved = service.call(
        "POST",
        f"/v1/rewrap/{retired}",
        {"batch": [{"ciphertext": old["ciphertext"], "to_key": target}]},
    )
    assert moved.status_code == 200
    (entry,) = moved.json()["batch"]
    back = service.call("POST", f"/v1/decrypt/{target}", {"ciphertext": entry["ciphertext"]})
    assert back.json()["plaintext"] == b64(b"old")


def test_min_encryption_version(service: Service) -> None:
    aes = create(service, "aes256-gcm")
    signer = create(service, "ed25519")
    mac_key = create(service, "hmac-sha512")
    v1 = service.call("POST", f"/v1/encrypt/{aes}", {"plaintext": b64(b"one")}).json()
    signed_v1 = service.call("POST", f"/v1/sign/{signer}", {"message": b64(b"m")}).json()
    for name in (aes, signer, mac_key, aes, signer, mac_key):
        assert service.call("POST", f"/v1/keys/{name}/rotate").status_code == 200
    for name in (aes, signer, mac_key):
        assert patch(service, name, min_encryption_version=2)["min_encryption_version"] == 2

    # The default is the latest version; naming one below the floor is 400, as in Vault.
    encrypted = service.call("POST", f"/v1/encrypt/{aes}", {"plaintext": b64(b"x")})
    assert encrypted.json()["key_version"] == 3
    below = service.call("POST", f"/v1/encrypt/{aes}", {"plaintext": "", "key_version": 1})
    assert "below min_encryption_version 2" in error(below, 400, "invalid_request")
    at = service.call("POST", f"/v1/encrypt/{aes}", {"plaintext": "", "key_version": 2})
    assert at.json()["key_version"] == 2
    sign_below = service.call(
        "POST", f"/v1/sign/{signer}", {"message": b64(b"m"), "key_version": 1}
    )
    error(sign_below, 400, "invalid_request")
    hmac_below = service.call(
        "POST", f"/v1/hmac/{mac_key}", {"message": b64(b"m"), "key_version": 1}
    )
    error(hmac_below, 400, "invalid_request")
    # Decryption and verification of older versions are not affected.
    opened = service.call("POST", f"/v1/decrypt/{aes}", {"ciphertext": v1["ciphertext"]})
    assert opened.json() == {"plaintext": b64(b"one"), "key_version": 1}
    verified = service.call(
        "POST",
        f"/v1/verify/{signer}",
        {"message": b64(b"m"), "signature": signed_v1["signature"], "key_version": 1},
    )
    assert verified.json() == {"valid": True}
    rewrapped = service.call("POST", f"/v1/rewrap/{aes}", {"ciphertext": v1["ciphertext"]})
    assert rewrapped.json()["key_version"] == 3

    # The rules between the fields (Vault Transit's): 0 or min_decryption..latest.
    text = error(
        service.call("PATCH", f"/v1/keys/{aes}", {"min_encryption_version": 4}),
        400,
        "invalid_request",
    )
    assert "at most 3" in text
    error(
        service.call("PATCH", f"/v1/keys/{aes}", {"min_decryption_version": 3}),
        400,
        "invalid_request",
    )
    both = patch(service, aes, min_decryption_version=3, min_encryption_version=3)
    assert (both["min_decryption_version"], both["min_encryption_version"]) == (3, 3)
    error(
        service.call("PATCH", f"/v1/keys/{aes}", {"min_encryption_version": 2}),
        400,
        "invalid_request",
    )
    assert patch(service, aes, min_encryption_version=0)["min_encryption_version"] == 0
    listed = {k["name"]: k for k in service.call("GET", "/v1/keys").json()["keys"]}
    assert listed[signer]["min_encryption_version"] == 2


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"state": "pending_deletion"}, 400),
        ({"state": "retired"}, 400),
        ({"state": 1}, 400),
        ({"state": None}, 400),
        ({"min_encryption_version": -1}, 400),
        ({"min_encryption_version": "2"}, 400),
        ({"min_encryption_version": True}, 400),
        ({"min_encryption_version": 1.5}, 400),
        ({"state": "enabled", "colour": "red"}, 422),
    ],
)
def test_patch_validation(service: Service, body: dict[str, Any], status: int) -> None:
    name = create(service, "aes256-gcm")
    before = service.call("GET", f"/v1/keys/{name}").json()
    error(service.call("PATCH", f"/v1/keys/{name}", body), status, "invalid_request")
    assert service.call("GET", f"/v1/keys/{name}").json() == before


def test_unknown_keys(service: Service) -> None:
    error(service.call("PATCH", "/v1/keys/ghost", {"state": "disabled"}), 404, "key_not_found")
    cancel = service.call("POST", "/v1/keys/ghost/cancel-deletion")
    error(cancel, 404, "key_not_found")


def parse_date(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def test_deletion_waits_can_be_cancelled_and_destroys_after_the_date(service: Service) -> None:
    name = create(service, "aes256-gcm")
    token = service.call("POST", f"/v1/encrypt/{name}", {"plaintext": b64(b"keep")}).json()
    patch(service, name, state="decrypt_only")
    # Deletion needs deletion_allowed, with or without a waiting period.
    error(service.call("DELETE", f"/v1/keys/{name}"), 409, "conflict")
    patch(service, name, deletion_allowed=True)

    started = time.time()
    scheduled = service.call("DELETE", f"/v1/keys/{name}")
    assert scheduled.status_code == 202, scheduled.text
    pending = scheduled.json()
    responses.KeyMetadata.model_validate(pending)  # what the OpenAPI document declares
    assert pending["state"] == "pending_deletion"
    assert pending["name"] == name
    date = parse_date(pending["deletion_date"])
    assert started + WAITING_PERIOD <= date <= started + WAITING_PERIOD + 2
    assert (
        service.call("GET", f"/v1/keys/{name}").json()["deletion_date"] == pending["deletion_date"]
    )

    # Meanwhile every operation and every change is refused, the name stays taken.
    decrypt = service.call("POST", f"/v1/decrypt/{name}", {"ciphertext": token["ciphertext"]})
    assert "pending_deletion: decrypt is refused" in error(decrypt, 409, "key_disabled")
    for method, path, body in [
        ("PATCH", f"/v1/keys/{name}", {"state": "enabled"}),
        ("POST", f"/v1/keys/{name}/rotate", None),
        ("DELETE", f"/v1/keys/{name}", None),
        ("GET", f"/v1/keys/{name}/backup", None),
    ]:
        error(service.call(method, path, body), 409, "key_disabled")
    taken = service.call("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"})
    assert "pending deletion" in error(taken, 409, "conflict")

    # Cancelled: the state it had before, and the data it protects still opens.
    restored = service.call("POST", f"/v1/keys/{name}/cancel-deletion")
    assert restored.status_code == 200
    responses.KeyMetadata.model_validate(restored.json())
    assert restored.json()["state"] == "decrypt_only"
    assert "deletion_date" not in restored.json()
    opened = service.call("POST", f"/v1/decrypt/{name}", {"ciphertext": token["ciphertext"]})
    assert opened.json()["plaintext"] == b64(b"keep")
    error(service.call("POST", f"/v1/keys/{name}/cancel-deletion"), 409, "conflict")
    # A key whose deletion is cancelled outlives the date it had (checked below).
    kept = create(service, "aes256-gcm", deletion_allowed=True)
    assert service.call("DELETE", f"/v1/keys/{kept}").status_code == 202
    assert service.call("POST", f"/v1/keys/{kept}/cancel-deletion").status_code == 200

    # Scheduled again: after the date the key is gone, and the scheduler destroys it.
    pending = service.call("DELETE", f"/v1/keys/{name}").json()
    assert name in service.stored_keys()
    wait_for(lambda: time.time() >= parse_date(pending["deletion_date"]), timeout=10)
    error(service.call("GET", f"/v1/keys/{name}"), 404, "key_not_found")
    assert name not in {k["name"] for k in service.call("GET", "/v1/keys").json()["keys"]}
    error(service.call("POST", f"/v1/keys/{name}/cancel-deletion"), 404, "key_not_found")
    wait_for(lambda: name not in service.stored_keys(), timeout=10, what="the destruction")
    assert kept in service.stored_keys()
    assert service.call("GET", f"/v1/keys/{kept}").json()["state"] == "enabled"

    # The name is free again: a new key, whose material opens nothing of the old one.
    again = service.call("POST", f"/v1/keys/{name}", {"type": "aes256-gcm"})
    assert again.status_code == 201
    assert again.json()["latest_version"] == 1
    stale = service.call("POST", f"/v1/decrypt/{name}", {"ciphertext": token["ciphertext"]})
    error(stale, 400, "decryption_failed")

    events = [
        (line["event"], line["outcome"], line.get("state"), line.get("previous_state"))
        for line in service.audit()
        if line["key"] == name and line["event"] != "decrypt"
    ]
    assert ("key.state", "ok", "decrypt_only", "enabled") in events
    assert ("key.delete", "scheduled", None, None) in events
    assert ("key.cancel_deletion", "ok", "decrypt_only", None) in events
    destroyed = [line for line in service.audit() if line["event"] == "key.destroy"]
    assert any(line["key"] == name and line["client"] is None for line in destroyed)
    scheduled_lines = [
        line for line in service.audit() if line["event"] == "key.delete" and line["key"] == name
    ]
    assert all(
        "deletion_date" in line for line in scheduled_lines if line["outcome"] == "scheduled"
    )


def test_a_key_past_its_date_is_never_served_and_its_name_is_free(service: Service) -> None:
    """Before the scheduler has run: no operation, and a create takes the name over (the
    old key destroyed in the same transaction)."""
    name = create(service, "aes256-gcm", deletion_allowed=True)
    pending = service.call("DELETE", f"/v1/keys/{name}").json()
    wait_for(lambda: time.time() >= parse_date(pending["deletion_date"]), timeout=10)
    encrypt = service.call("POST", f"/v1/encrypt/{name}", {"plaintext": ""})
    error(encrypt, 404, "key_not_found")
    created = service.call("POST", f"/v1/keys/{name}", {"type": "sm4-gcm"})
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "enabled"
    assert service.call("GET", f"/v1/keys/{name}").json()["type"] == "sm4-gcm"


# The light client and `cryptd call` ------------------------------------------------------


def credential(service: Service) -> Path:
    return service.server.directory / "dev" / "client.json"


def test_the_client_changes_states_and_schedules_deletion(service: Service) -> None:
    from cryptd_client import CryptdClient, KeyDisabledError, KeyMetadata

    with CryptdClient.from_file(credential(service)) as client:
        name = unique("client")
        client.create_key(name, "aes256-gcm", deletion_allowed=True)
        client.rotate_key(name)
        updated = client.update_key(name, state="decrypt_only", min_encryption_version=2)
        assert isinstance(updated, KeyMetadata)
        assert (updated.state, updated.min_encryption_version) == ("decrypt_only", 2)
        with pytest.raises(KeyDisabledError) as refused:
            client.encrypt(name, b"x")
        assert refused.value.status == 409
        assert "decrypt_only: encrypt is refused" in refused.value.message
        with pytest.raises(TypeError):
            client.update_key(name, state=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="at least one"):
            client.update_key(name)
        pending = client.delete_key(name)
        assert pending is not None
        assert pending.state == "pending_deletion"
        assert pending.deletion_date is not None
        assert client.get_key(name).deletion_date == pending.deletion_date
        restored = client.cancel_deletion(name)
        assert (restored.state, restored.deletion_date) == ("decrypt_only", None)
        assert client.update_key(name, state="enabled").state == "enabled"
        listed = {k.name: k for k in client.list_keys()}
        assert listed[name].state == "enabled"


async def test_the_async_client_changes_states_and_schedules_deletion(service: Service) -> None:
    from cryptd_client import AsyncCryptdClient

    async with AsyncCryptdClient.from_file(credential(service)) as client:
        name = unique("async")
        await client.create_key(name, "sm4-gcm", deletion_allowed=True)
        disabled = await client.update_key(name, state="disabled")
        assert disabled.state == "disabled"
        pending = await client.delete_key(name)
        assert pending is not None
        assert pending.state == "pending_deletion"
        restored = await client.cancel_deletion(name)
        assert restored.state == "disabled"


def test_a_deletion_without_waiting_period_returns_none(server: Server) -> None:
    from cryptd_client import CryptdClient

    with CryptdClient(server.url, server.client_id, base64.b64encode(server.secret).decode()) as c:
        name = unique("now")
        c.create_key(name, "aes256-gcm", deletion_allowed=True)
        assert c.delete_key(name) is None
        assert name not in {k.name for k in c.list_keys()}


def test_cryptd_call_update_delete_and_cancel(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    def run(*args: str) -> tuple[int, Any, str]:
        status = main(["call", *args, "--credential", str(credential(service))])
        out = capsys.readouterr()
        return status, json.loads(out.out) if out.out.strip() else None, out.err

    name = unique("cli")
    assert run("create", name, "--type", "aes256-gcm")[0] == 0
    status, updated, _ = run("update", name, "--state", "decrypt_only")
    assert (status, updated["state"]) == (0, "decrypt_only")
    status, _, err = run("encrypt", name, "--data", "probe")
    assert status == 1
    assert json.loads(err)["error"]["code"] == "key_disabled"
    status, _, err = run("delete", name)
    assert status == 1
    assert json.loads(err)["error"]["code"] == "conflict"  # deletion not allowed yet
    status, updated, _ = run("update", name, "--deletion-allowed", "true")
    assert (status, updated["deletion_allowed"]) == (0, True)
    status, pending, _ = run("delete", name)
    assert (status, pending["state"]) == (0, "pending_deletion")
    assert "deletion_date" in pending
    status, restored, _ = run("cancel-deletion", name)
    assert (status, restored["state"]) == (0, "decrypt_only")
    status, updated, _ = run("update", name, "--min-encryption-version", "1", "--state", "enabled")
    assert (status, updated["state"], updated["min_encryption_version"]) == (0, "enabled", 1)
