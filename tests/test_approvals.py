"""Dual control from outside: a real server (two workers, the keyring file) with every operation
named in CRYPTD_APPROVALS and three admin clients. Each operation waits for a second admin,
runs once for its requester only, exactly as requested; every step is in the audit trail."""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from service.auth.clients import generate_secret, write_document
from tests.conftest import Server, start_server, stop_server
from tests.test_api import assert_error
from tests.test_byok import byok_wrap, wrapping_public_key
from tests.test_keystore_support import replicas

pytestmark = pytest.mark.slow

ALL = "delete,backup,import,restore,enable,rotate-master-key"
ADMINS = ("alice", "bob")


class Admin:
    """One client of the server, by id."""

    def __init__(self, server: Server, client_id: str, secret: bytes) -> None:
        self.server, self.client_id, self.secret = server, client_id, secret

    def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        approval: str | None = None,
        raw: bytes | None = None,
    ) -> httpx.Response:
        headers = {"X-Approval-ID": approval} if approval is not None else None
        return self.server.request(
            method,
            path,
            body,
            raw=raw,
            headers=headers,
            client_id=self.client_id,
            secret=self.secret,
        )


def prepared_state(directory: Path) -> dict[str, bytes]:
    """The development state's master key and a clients file with the development client,
    two more admins and a client that is no admin; their secrets."""
    state = directory / "dev"
    state.mkdir(parents=True, mode=0o700)
    (state / "master.key").write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    os.chmod(state / "master.key", 0o600)
    secrets = {name: generate_secret() for name in ("dev", *ADMINS, "carol")}
    clients = {
        name: {
            "secret": secret,
            "admin": name != "carol",
            "allow": [{"keys": "*", "operations": ["*"]}],
        }
        for name, secret in secrets.items()
    }
    write_document(state / "clients.json", {"clients": clients})
    return {name: base64.b64decode(secret) for name, secret in secrets.items()}


@pytest.fixture(scope="module")
def dual(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Admin], Path]]:
    directory = tmp_path_factory.mktemp("approvals")
    secrets = prepared_state(directory)
    audit = directory / "audit"
    audit.mkdir()
    server = start_server(
        directory,
        {"CRYPTD_APPROVALS": ALL, "CRYPTD_AUDIT_LOG": str(audit / "audit.log")},
        workers=2,
    )
    try:
        yield {name: Admin(server, name, secret) for name, secret in secrets.items()}, audit
    finally:
        stop_server(server)


def requested(response: httpx.Response, operation: str, key: str) -> str:
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["operation"] == operation
    assert body["key"] == key
    assert body["state"] == "pending"
    assert body["requested_by"] == "alice"
    assert body["expires_at"].endswith("Z")
    assert len(body["approval_id"]) == 32
    return str(body["approval_id"])


def approved(clients: dict[str, Admin], approval_id: str) -> None:
    alice, bob = clients["alice"], clients["bob"]
    assert_error(alice("POST", f"/v1/approvals/{approval_id}/approve"), 403, "forbidden")
    assert_error(clients["carol"]("POST", f"/v1/approvals/{approval_id}/approve"), 403, "forbidden")
    assert bob("GET", f"/v1/approvals/{approval_id}").json()["state"] == "pending"
    answer = bob("POST", f"/v1/approvals/{approval_id}/approve")
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "approved"
    assert answer.json()["decided_by"] == "bob"


def refused_then_run(
    clients: dict[str, Admin],
    approval_id: str,
    method: str,
    path: str,
    body: Any,
    other: tuple[str, Any],
    status: int,
) -> httpx.Response:
    """Another client (403), another request (400), then the requester: ``status``; then a
    replay (409)."""
    alice, bob = clients["alice"], clients["bob"]
    assert_error(bob(method, path, body, approval_id), 403, "forbidden")
    assert_error(alice(method, other[0], other[1], approval_id), 400, "invalid_request")
    done = alice(method, path, body, approval_id)
    assert done.status_code == status, done.text
    assert_error(alice(method, path, body, approval_id), 409, "conflict")
    used = bob("GET", f"/v1/approvals/{approval_id}").json()
    assert used["state"] == "used"
    assert used["used_at"] is not None
    return done


def test_each_named_operation_waits_for_a_second_admin(
    dual: tuple[dict[str, Admin], Path],
) -> None:
    clients, audit = dual
    alice, dev = clients["alice"], clients["dev"]
    made = {"type": "aes256-gcm", "deletion_allowed": True}
    assert dev("POST", "/v1/keys/dc-one", made).status_code == 201
    assert dev("POST", "/v1/keys/dc-two", made).status_code == 201
    token = dev("POST", "/v1/encrypt/dc-one", {"plaintext": "aGk="}).json()["ciphertext"]

    # backup: nothing leaves before a second admin approves.
    first = alice("GET", "/v1/keys/dc-one/backup")
    backup_id = requested(first, "backup", "dc-one")
    assert "backup" not in first.json()
    approved(clients, backup_id)
    blob = refused_then_run(
        clients, backup_id, "GET", "/v1/keys/dc-one/backup", None,
        ("/v1/keys/dc-two/backup", None), 200,
    ).json()["backup"]  # fmt: skip

    # delete: the key stays until the approved request runs.
    delete_id = requested(alice("DELETE", "/v1/keys/dc-one"), "delete", "dc-one")
    assert dev("POST", "/v1/decrypt/dc-one", {"ciphertext": token}).status_code == 200
    approved(clients, delete_id)
    refused_then_run(
        clients, delete_id, "DELETE", "/v1/keys/dc-one", None,
        ("/v1/keys/dc-two", None), 204,
    )  # fmt: skip
    assert dev("GET", "/v1/keys/dc-one").status_code == 404
    assert dev("GET", "/v1/keys/dc-two").status_code == 200  # the wrong request ran nothing

    # restore: bound to the body (the backup) too.
    restore_id = requested(
        alice("POST", "/v1/keys/dc-one/restore", {"backup": blob}), "restore", "dc-one"
    )
    assert dev("GET", "/v1/keys/dc-one").status_code == 404
    approved(clients, restore_id)
    # Another body for the same path is another request.
    other = {"backup": base64.b64encode(b"x" + base64.b64decode(blob)).decode()}
    refused_then_run(
        clients, restore_id, "POST", "/v1/keys/dc-one/restore", {"backup": blob},
        ("/v1/keys/dc-one/restore", other), 201,
    )  # fmt: skip
    assert dev("POST", "/v1/decrypt/dc-one", {"ciphertext": token}).status_code == 200

    # enable: disabled -> enabled waits; other changes (disabling) do not.
    assert dev("PATCH", "/v1/keys/dc-one", {"state": "disabled"}).status_code == 200
    enable_id = requested(
        alice("PATCH", "/v1/keys/dc-one", {"state": "enabled"}), "enable", "dc-one"
    )
    assert dev("GET", "/v1/keys/dc-one").json()["state"] == "disabled"
    approved(clients, enable_id)
    refused_then_run(
        clients, enable_id, "PATCH", "/v1/keys/dc-one", {"state": "enabled"},
        ("/v1/keys/dc-two", {"state": "enabled"}), 200,
    )  # fmt: skip
    assert dev("GET", "/v1/keys/dc-one").json()["state"] == "enabled"
    assert dev("PATCH", "/v1/keys/dc-one", {"state": "enabled"}).status_code == 200  # no-op

    # import: the approval keeps a digest of the wrapped material, never the material.
    public = wrapping_public_key(dev.server)
    material = os.urandom(32)
    body = {"type": "aes256-gcm", "ciphertext": byok_wrap(public, material)}
    import_id = requested(alice("POST", "/v1/keys/dc-imp/import", body), "import", "dc-imp")
    approved(clients, import_id)
    keyring = (dev.server.directory / "dev" / "keyring.json").read_text()
    assert import_id in keyring
    assert body["ciphertext"] not in keyring
    refused_then_run(
        clients, import_id, "POST", "/v1/keys/dc-imp/import", body,
        ("/v1/keys/dc-imp2/import", body), 201,
    )  # fmt: skip
    assert dev("GET", "/v1/keys/dc-imp2").status_code == 404

    # Every step is in the audit trail with its approval id.
    records = [
        orjson.loads(line)
        for path in sorted(audit.iterdir())
        for line in path.read_bytes().splitlines()
    ]
    for approval_id, event in (
        (backup_id, "key.backup"),
        (delete_id, "key.delete"),
        (restore_id, "key.restore"),
        (enable_id, "key.state"),
        (import_id, "key.import"),
    ):
        mine = [r for r in records if r.get("approval_id") == approval_id]
        outcomes = [(r["event"], r["status"]) for r in mine]
        assert (event if event != "key.state" else "key.update", 202) in outcomes, outcomes
        assert ("approval.approve", 200) in outcomes
        assert ("approval.approve", 403) in outcomes
        assert any(r["event"] == event and r["status"] in (200, 201, 204) for r in mine)
        assert sum(1 for r in mine if r["status"] == 409) == 1
        assert all(r["client"] in ("alice", "bob", "carol") for r in mine)
    assert all(material.hex() not in line for line in map(str, records))


def test_rejected_unknown_and_malformed_approvals(dual: tuple[dict[str, Admin], Path]) -> None:
    clients, _ = dual
    alice, bob, carol, dev = clients["alice"], clients["bob"], clients["carol"], clients["dev"]
    assert dev("POST", "/v1/keys/dc-keep", {"type": "aes256-gcm"}).status_code == 201
    # Not an admin: refused before anything is recorded.
    assert_error(carol("DELETE", "/v1/keys/dc-keep"), 403, "forbidden")
    # A key that does not exist gets no approval.
    assert_error(alice("DELETE", "/v1/keys/dc-never"), 404, "key_not_found")

    approval_id = requested(alice("DELETE", "/v1/keys/dc-keep"), "delete", "dc-keep")
    # Pending: not yet usable.
    assert_error(alice("DELETE", "/v1/keys/dc-keep", approval=approval_id), 409, "conflict")
    rejected = bob("POST", f"/v1/approvals/{approval_id}/reject")
    assert rejected.status_code == 200
    assert rejected.json()["state"] == "rejected"
    assert_error(bob("POST", f"/v1/approvals/{approval_id}/approve"), 409, "conflict")
    assert_error(alice("DELETE", "/v1/keys/dc-keep", approval=approval_id), 409, "conflict")
    assert dev("GET", "/v1/keys/dc-keep").status_code == 200

    unknown = "0" * 32
    assert_error(alice("DELETE", "/v1/keys/dc-keep", approval=unknown), 404, "not_found")
    assert_error(bob("GET", f"/v1/approvals/{unknown}"), 404, "not_found")
    assert_error(alice("DELETE", "/v1/keys/dc-keep", approval="nope"), 400, "invalid_request")
    assert_error(bob("POST", "/v1/approvals/NOT-AN-ID/approve"), 400, "invalid_request")
    assert_error(carol("GET", f"/v1/approvals/{approval_id}"), 403, "forbidden")

    # An approval for one request presented with an operation no approval covers: 400.
    second = requested(alice("DELETE", "/v1/keys/dc-keep"), "delete", "dc-keep")
    assert bob("POST", f"/v1/approvals/{second}/approve").status_code == 200
    rotate = alice("POST", "/v1/keys/dc-keep/rotate", approval=second)
    assert_error(rotate, 400, "invalid_request")
    assert dev("GET", "/v1/keys/dc-keep").json()["latest_version"] == 1
    # The requester may withdraw its own request.
    assert alice("POST", f"/v1/approvals/{second}/reject").json()["state"] == "rejected"
    assert dev("GET", "/v1/keys/dc-keep").status_code == 200


def test_concurrent_executions_run_once(dual: tuple[dict[str, Admin], Path]) -> None:
    clients, _ = dual
    alice, bob, dev = clients["alice"], clients["bob"], clients["dev"]
    assert dev("POST", "/v1/keys/dc-race", {"type": "aes256-gcm"}).status_code == 201
    approval_id = requested(alice("GET", "/v1/keys/dc-race/backup"), "backup", "dc-race")
    assert bob("POST", f"/v1/approvals/{approval_id}/approve").status_code == 200
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def execute() -> None:
        start.wait()
        status = alice("GET", "/v1/keys/dc-race/backup", approval=approval_id).status_code
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=execute) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [200] + [409] * 7


def test_replicas_on_postgresql_share_approvals_and_spend_them_once(
    tmp_path: Path, pg_database: str
) -> None:
    secrets = prepared_state(tmp_path / "replica-0")
    with replicas(tmp_path, pg_database, env={"CRYPTD_APPROVALS": "delete"}, workers=1) as pair:
        on = [
            {name: Admin(server, name, secret) for name, secret in secrets.items()}
            for server in pair
        ]
        made = {"type": "aes256-gcm", "deletion_allowed": True}
        assert on[0]["dev"]("POST", "/v1/keys/dc-shared", made).status_code == 201
        approval_id = requested(
            on[0]["alice"]("DELETE", "/v1/keys/dc-shared"), "delete", "dc-shared"
        )
        # Seen and approved on the other replica, at once.
        seen = on[1]["bob"]("GET", f"/v1/approvals/{approval_id}")
        assert seen.status_code == 200, seen.text
        assert seen.json()["state"] == "pending"
        assert_error(
            on[1]["alice"]("POST", f"/v1/approvals/{approval_id}/approve"), 403, "forbidden"
        )
        assert on[1]["bob"]("POST", f"/v1/approvals/{approval_id}/approve").status_code == 200
        statuses: list[int] = []
        lock = threading.Lock()
        start = threading.Barrier(6)

        def execute(alice: Admin) -> None:
            start.wait()
            status = alice("DELETE", "/v1/keys/dc-shared", approval=approval_id).status_code
            with lock:
                statuses.append(status)

        threads = [threading.Thread(target=execute, args=(on[i % 2]["alice"],)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(statuses) == [204] + [409] * 5
        for side in on:
            assert side["dev"]("GET", "/v1/keys/dc-shared").status_code == 404


def test_master_key_rotation_waits_for_a_second_admin(
    dual: tuple[dict[str, Admin], Path],
) -> None:
    clients, _ = dual
    alice, bob, dev = clients["alice"], clients["bob"], clients["dev"]
    made = {"type": "aes256-gcm"}
    assert dev("POST", "/v1/keys/dc-rotated", made).status_code == 201
    token = dev("POST", "/v1/encrypt/dc-rotated", {"plaintext": "aGk="}).json()["ciphertext"]
    path = "/v1/sys/rotate-master-key"
    first = alice("POST", path, {})
    assert first.status_code == 202, first.text
    body = first.json()
    assert body["operation"] == "rotate-master-key"
    approval_id = str(body["approval_id"])
    approved(clients, approval_id)
    assert_error(bob("POST", path, {}, approval_id), 403, "forbidden")
    done = alice("POST", path, {}, approval_id)
    assert done.status_code == 200, done.text
    assert done.json()["master_key_id"] != done.json()["previous_master_key_id"]
    assert_error(alice("POST", path, {}, approval_id), 409, "conflict")
    # The key versions were rewrapped under the new master key: the old token still decrypts.
    again = dev("POST", "/v1/decrypt/dc-rotated", {"ciphertext": token})
    assert again.status_code == 200, again.text
    assert again.json()["plaintext"] == "aGk="
