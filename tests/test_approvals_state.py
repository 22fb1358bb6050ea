"""Dual control's rules over the stored approvals (service/keys/approvals.py), at any moment:
expiry, binding, who may do what, pruning; the records in the keyring document under its MAC;
the settings that name the operations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import Settings
from service.errors import Conflict, Forbidden, InvalidRequest
from service.keys import approvals
from service.keys.approvals import Approval
from service.keys.document import KeyringDocument, MalformedDocument, RawDocument
from service.keys.integrity import open_document, seal
from service.keys.masterkey import MasterKey
from service.keys.store import IntegrityError, KeyStore

NOW = 1_800_000_000.0
TTL = 600


def pending(store: dict[str, Approval], body: bytes = b'{"backup":"x"}') -> str:
    approval_id, _ = approvals.request(
        store,
        operation="restore",
        key="k",
        method="POST",
        path="/v1/keys/k/restore",
        body=body,
        client="alice",
        ttl=TTL,
        now=NOW,
    )
    return approval_id


def claim(store: dict[str, Approval], approval_id: str, **changes: object) -> Approval:
    arguments: dict[str, object] = {
        "client": "alice",
        "operation": "restore",
        "method": "POST",
        "path": "/v1/keys/k/restore",
        "body": b'{"backup":"x"}',
        "now": NOW + 1,
        **changes,
    }
    return approvals.claim(store, approval_id, **arguments)  # type: ignore[arg-type]


def test_an_approval_runs_once_for_its_requester_and_its_request_only() -> None:
    store: dict[str, Approval] = {}
    approval_id = pending(store)
    with pytest.raises(Conflict, match="pending"):
        claim(store, approval_id)
    with pytest.raises(Forbidden):
        approvals.decide(store, approval_id, "alice", approve=True, now=NOW)
    approvals.decide(store, approval_id, "bob", approve=True, now=NOW)
    with pytest.raises(Forbidden):
        claim(store, approval_id, client="bob")
    for other in ({"body": b'{"backup":"y"}'}, {"path": "/v1/keys/j/restore"}, {"method": "PUT"}):
        with pytest.raises(InvalidRequest):
            claim(store, approval_id, **other)
    assert store[approval_id].state == approvals.APPROVED  # nothing spent by those
    assert claim(store, approval_id).state == approvals.USED
    with pytest.raises(Conflict, match="used"):
        claim(store, approval_id)
    approvals.release(store, approval_id, "alice")  # the operation was refused: usable again
    assert claim(store, approval_id).used_at == int(NOW + 1)


def test_expiry_rejection_and_pruning() -> None:
    store: dict[str, Approval] = {}
    approval_id = pending(store)
    approvals.decide(store, approval_id, "bob", approve=True, now=NOW)
    with pytest.raises(Conflict, match="expired"):
        claim(store, approval_id, now=NOW + TTL)
    assert store[approval_id].view(approval_id, NOW + TTL)["state"] == "expired"
    late = pending(store)
    with pytest.raises(Conflict, match="expired"):
        approvals.decide(store, late, "bob", approve=True, now=NOW + TTL)
    rejected = pending(store)
    approvals.decide(store, rejected, "bob", approve=False, now=NOW)
    with pytest.raises(Conflict, match="rejected by bob"):
        claim(store, rejected)
    # Kept a day past expiry (a replay is told 409), then gone (404).
    pending(store)
    assert len(store) == 4
    approvals.prune(store, NOW + TTL + approvals.RETENTION)
    assert store == {}
    with pytest.raises(approvals.ApprovalNotFound):
        claim(store, approval_id)
    with pytest.raises(InvalidRequest):
        claim(store, "../" + approval_id)


def test_open_approvals_are_bounded() -> None:
    store: dict[str, Approval] = {}
    for _ in range(approvals.MAX_OPEN):
        pending(store)
    with pytest.raises(Conflict, match="open already"):
        pending(store)


def test_the_binding_keeps_no_body_and_separates_its_parts() -> None:
    material = b'{"ciphertext":"c2VjcmV0IG1hdGVyaWFs"}'
    store: dict[str, Approval] = {}
    approval_id = pending(store, material)
    assert b"c2VjcmV0" not in str(store[approval_id].to_json()).encode()
    assert approvals.binding("POST", "/a", b"b") != approvals.binding("POST", "/ab", b"")
    assert len(approvals.binding("GET", "/", b"")) == 64


def test_approvals_are_in_the_document_under_its_mac() -> None:
    master = MasterKey(bytes(range(32)))
    document = KeyringDocument(master_key_id=master.key_id, deployment_id="d" * 32, generation=1)
    empty, _ = seal(document, master)
    assert "approvals" not in empty  # a keyring that never used them reads as before
    approval_id = pending(document.approvals)
    raw, _ = seal(document, master)
    opened = open_document(raw, master).document
    assert opened.approvals == document.approvals
    # Approving it by editing the store, without the master key, is refused.
    raw["approvals"][approval_id]["state"] = "approved"
    raw["approvals"][approval_id]["decided_by"] = "mallory"
    with pytest.raises(IntegrityError):
        open_document(raw, master)
    broken = document.render()
    broken["approvals"][approval_id]["state"] = "whatever"
    with pytest.raises(MalformedDocument):
        KeyringDocument.parse(broken)


def test_settings_name_the_operations() -> None:
    every = "delete, backup,import,restore,enable,rotate-master-key,delete"
    settings = Settings(env="development", approvals=every, approval_ttl=120)
    assert settings.approval_operations() == frozenset(approvals.OPERATIONS)
    assert settings.approval_ttl == 120
    assert Settings(env="development").approval_operations() == frozenset()
    with pytest.raises(ValidationError, match="destroy"):
        Settings(env="development", approvals="delete,destroy")
    with pytest.raises(ValidationError):
        Settings(env="development", approval_ttl=10)


def write(store: KeyStore, raw: RawDocument) -> None:
    with store.transaction() as transaction:
        transaction.read()
        transaction.write(raw)


def test_a_postgresql_store_made_before_approvals_says_how_to_add_them(pg_database: str) -> None:
    import psycopg

    from service.keys.admin import initialise
    from service.keys.pgstore import PostgresKeyStore
    from service.keys.store import StoreUnavailable

    master = MasterKey(bytes(range(32)))
    store = PostgresKeyStore(pg_database)
    try:
        initialise(store, master)
        with psycopg.connect(pg_database, autocommit=True) as conn:
            conn.execute("DROP TABLE cryptd_approvals")
        before = store.read()
        assert before is not None
        assert "approvals" not in before  # read as holding none, served as before
        document = open_document(before, master).document
        document.generation += 1
        pending(document.approvals)
        with pytest.raises(StoreUnavailable, match="cryptd keystore schema"):
            write(store, seal(document, master)[0])
        assert store.read() == before  # nothing written
        store.create_schema()  # what `cryptd keystore schema` prints: the table, once
        write(store, seal(document, master)[0])
        stored = store.read()
        assert stored is not None
        assert open_document(stored, master).document.approvals == document.approvals
    finally:
        store.close()
