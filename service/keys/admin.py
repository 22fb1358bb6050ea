"""Operator tasks on key stores: create an empty keyring, copy one store into another.

A copy moves the wrapped material as it is: nothing is unwrapped or wrapped again, so the
copy needs no more trust than the source. The master key verifies the source before anything
is written and the copy after; a target that already holds a keyring is never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.keys.document import FORMAT, KeyringDocument
from service.keys.filestore import FileKeyStore
from service.keys.integrity import new_deployment_id, open_document, seal
from service.keys.masterkey import MasterKey
from service.keys.store import IntegrityError, KeyStore, NotInitialised


class TargetNotEmpty(FileExistsError):
    """The target store already holds a keyring."""


@dataclass(frozen=True)
class CopyReport:
    keys: int
    versions: int
    deployment_id: str
    generation: int
    digest: str


def prepare(store: KeyStore) -> None:
    """Create the database schema where the store has one (PostgreSQL); idempotent."""
    create_schema = getattr(store, "create_schema", None)
    if create_schema is not None:
        create_schema()


def initialise(store: KeyStore, master: MasterKey) -> KeyringDocument:
    """An empty keyring (a new deployment id, generation 1) in an empty store."""
    prepare(store)
    document = KeyringDocument(
        master_key_id=master.key_id, deployment_id=new_deployment_id(), generation=1
    )
    with store.transaction() as transaction:
        if transaction.read() is not None:
            raise TargetNotEmpty(f"{store.description} already holds a keyring")
        transaction.write(seal(document, master)[0])
    return document


def create_keyring_file(path: Path, master: MasterKey) -> None:
    """Write an empty keyring file (refuses to overwrite an existing one)."""
    initialise(FileKeyStore(path), master)


def copy_keyring(source: KeyStore, target: KeyStore, master: MasterKey) -> CopyReport:
    """Copy every key and version from ``source`` into the empty ``target``, verified on both
    ends. A keyring file older than deployment ids gets one now (generation 1): the document
    header changes, the material does not."""
    raw = source.read()
    if raw is None:
        raise NotInitialised(f"{source.description} holds no keyring")
    verified = open_document(raw, master)
    document = verified.document.copy()
    if document.format != FORMAT:
        document.format = FORMAT
        document.deployment_id = new_deployment_id()
        document.generation = 1
    sealed, digest = seal(document, master)
    prepare(target)
    with target.transaction() as transaction:
        if transaction.read() is not None:
            raise TargetNotEmpty(f"{target.description} already holds a keyring")
        transaction.write(sealed)
    copied_raw = target.read()
    if copied_raw is None:
        raise IntegrityError(f"the copy in {target.description} cannot be read back")
    copied = open_document(copied_raw, master)
    if copied.digest != digest or copied.document.keys != verified.document.keys:
        raise IntegrityError(f"the copy in {target.description} differs from the source")
    assert document.deployment_id is not None
    return CopyReport(
        keys=len(document.keys),
        versions=sum(len(r.versions) for r in document.keys.values()),
        deployment_id=document.deployment_id,
        generation=document.generation,
        digest=digest,
    )
