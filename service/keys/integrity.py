"""Trust above the stores: the document MAC, its verification, and the building of a keyring
from a verified document. Every store hands its content here and nothing is served or written
that did not pass :func:`open_document`, so no store can launder what it cannot verify.

What a writer without the master key cannot do unnoticed: change any metadata (lower
``min_decryption_version``, allow deletion, enable a disabled key, move a deletion date),
move material between keys or versions, remove a key or a version, present another
deployment's keyring (another master key: its id; the same master key: the deployment id,
refused by a process that already serves this deployment), or roll a running process back
to an older valid snapshot (the generation, which only rises).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from service.crypto.registry import KEY_TYPES
from service.keys.document import (
    FORMAT,
    KeyRecord,
    KeyringDocument,
    MalformedDocument,
    RawDocument,
    canonical,
)
from service.keys.keyring import Key, Keyring, KeyVersion, load_handle
from service.keys.masterkey import MasterKey, WrongMasterKey
from service.keys.store import IntegrityError


@dataclass(frozen=True, slots=True)
class Verified:
    """A document whose MAC verified, and the digest that identifies its content."""

    document: KeyringDocument
    digest: str


def new_deployment_id() -> str:
    return secrets.token_hex(8)


def digest_of(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()[:16]


def seal(document: KeyringDocument, master: MasterKey) -> tuple[RawDocument, str]:
    """The document as a store keeps it, with its MAC; and its digest."""
    raw = document.render()
    content = canonical(raw)
    raw["mac"] = base64.b64encode(master.mac(content)).decode()
    return raw, digest_of(content)


def open_document(
    raw: RawDocument, master: MasterKey, reuse: tuple[RawDocument, KeyringDocument] | None = None
) -> Verified:
    """Verify ``raw`` under ``master`` and parse it; IntegrityError says what is wrong, never
    what the data holds. ``reuse``: a document verified before, raw and parsed; keys ``raw``
    shares with it are not parsed again (the MAC is still over the whole of ``raw``)."""
    if not isinstance(raw, dict):
        raise IntegrityError("the keyring is not a document")
    claimed = raw.get("master_key_id")
    if claimed != master.key_id:
        raise IntegrityError(
            f"the keyring was written under master key {str(claimed)[:16]!r}, "
            f"this process has {master.key_id} (wrong master key, or another deployment's "
            "keyring)"
        )
    mac = raw.get("mac")
    try:
        tag = base64.b64decode(mac, validate=True) if isinstance(mac, str) else b""
    except (binascii.Error, ValueError):
        tag = b""
    try:
        content = canonical(raw)
    except MalformedDocument as exc:
        raise IntegrityError(f"malformed keyring ({exc})") from None
    if not tag or not master.verify_mac(content, tag):
        raise IntegrityError(
            "keyring integrity check failed (its content does not match its MAC: a key, a "
            "version or metadata was changed, added or removed without the master key)"
        )
    try:
        document = KeyringDocument.parse(raw, reuse)
    except MalformedDocument as exc:
        raise IntegrityError(f"malformed keyring ({exc})") from None
    return Verified(document, digest_of(content))


def check_succession(current: Keyring | None, new: Verified, expected_id: str | None) -> None:
    """Refuse what a process serving ``current`` must not move to: another deployment, an
    older generation, or different content under the same generation."""
    document = new.document
    if expected_id is not None and document.deployment_id != expected_id:
        raise IntegrityError(
            f"the key store belongs to deployment {document.deployment_id!r}, this service is "
            f"configured for {expected_id!r} (CRYPTD_KEYSTORE_ID)"
        )
    if current is None:
        return
    if current.deployment_id is not None and document.deployment_id != current.deployment_id:
        raise IntegrityError(
            f"the key store now holds deployment {document.deployment_id!r}, this process "
            f"serves {current.deployment_id!r}: another deployment's keyring"
        )
    if document.generation < current.generation:
        raise IntegrityError(
            f"the keyring went back from generation {current.generation} to "
            f"{document.generation} (an older copy was restored); if that is intended, "
            "restart the service"
        )
    if (
        document.generation == current.generation
        and document.generation > 0
        and new.digest != current.digest
    ):
        raise IntegrityError(f"two different keyrings claim generation {document.generation}")


def next_document(verified: Verified) -> KeyringDocument:
    """A copy of a verified document to change, one generation up, in the current format."""
    document = verified.document.copy()
    document.format = FORMAT
    document.generation += 1
    if document.deployment_id is None:
        document.deployment_id = new_deployment_id()
    return document


def _same_material(
    master: MasterKey, blob: bytes, material: bytes, name: str, type_name: str, version: int
) -> bool:
    try:
        before = master.unwrap(blob, name=name, version=version, type_name=type_name)
    except WrongMasterKey:
        return False
    return hmac.compare_digest(before, material)


def rewrap(document: KeyringDocument, old: MasterKey, new: MasterKey) -> None:
    """Every version of every key unwrapped under ``old`` and wrapped under ``new``, in place;
    the document then names ``new``. IntegrityError (nothing usable) if a blob does not
    unwrap."""
    for name, record in document.keys.items():
        for v in record.versions:
            try:
                material = old.unwrap(
                    v.material, name=name, version=v.version, type_name=record.type
                )
            except WrongMasterKey as exc:
                raise IntegrityError(str(exc)) from None
            v.material = new.wrap(material, name=name, version=v.version, type_name=record.type)
    document.master_key_id = new.key_id


def build_keyring(
    verified: Verified,
    master: MasterKey,
    previous: Keyring | None = None,
    activation_delay: float = 0.0,
    previous_master: MasterKey | None = None,
    previous_records: Mapping[str, KeyRecord] | None = None,
) -> Keyring:
    """Unwrap and parse what ``previous`` does not already hold (the same blob at the same
    place is the same key: parsing an RSA key costs ~30 ms, so a change costs what it adds).
    ``previous_records``: the records ``previous`` was built from; a key whose record is the
    very same object (a refresh that read only the changed keys) keeps its built key whole.
    ``previous_master``: what ``previous`` was wrapped under, when a master-key rotation
    rewrapped every blob; a version whose material unwraps the same under both is kept as
    parsed (two AES-GCM opens instead of a parse). This is the only place material is
    unwrapped."""
    document = verified.document
    keys: dict[str, Key] = {}
    for name, record in document.keys.items():
        old = previous.get(name) if previous is not None else None
        if (
            old is not None
            and previous_master is None
            and previous_records is not None
            and previous_records.get(name) is record
        ):
            keys[name] = old  # the same record under the same master key: the same key
            continue
        key_type = KEY_TYPES[record.type]
        versions: dict[int, KeyVersion] = {}
        for v in record.versions:
            kept = old.versions.get(v.version) if old is not None else None
            if (
                kept is not None
                and old is not None
                and old.type is key_type
                and (old.derived, old.convergent) == (record.derived, record.convergent)
                and kept.wrapped == v.material
                and kept.created_at == v.created_at
            ):
                versions[v.version] = kept
                continue
            try:
                material = master.unwrap(
                    v.material, name=name, version=v.version, type_name=record.type
                )
                if (
                    kept is not None
                    and old is not None
                    and previous_master is not None
                    and old.type is key_type
                    and (old.derived, old.convergent) == (record.derived, record.convergent)
                    and kept.created_at == v.created_at
                    and _same_material(
                        previous_master, kept.wrapped, material, name, record.type, v.version
                    )
                ):
                    versions[v.version] = KeyVersion(
                        v.version, v.created_at, kept.handle, v.material
                    )
                    continue
                handle = load_handle(
                    key_type,
                    material,
                    name=name,
                    version=v.version,
                    derived=record.derived,
                    convergent=record.convergent,
                )
            except WrongMasterKey as exc:
                raise IntegrityError(str(exc)) from None
            except Exception as exc:
                raise IntegrityError(
                    f"key {name!r} version {v.version} does not load ({type(exc).__name__})"
                ) from None
            versions[v.version] = KeyVersion(v.version, v.created_at, handle, v.material)
        keys[name] = Key(
            name=name,
            type=key_type,
            created_at=record.created_at,
            min_decryption_version=record.min_decryption_version,
            deletion_allowed=record.deletion_allowed,
            versions=versions,
            activation_delay=activation_delay,
            auto_rotate_period=record.auto_rotate_period,
            derived=record.derived,
            convergent=record.convergent,
            state=record.state,
            min_encryption_version=record.min_encryption_version,
            deletion_date=record.deletion_date,
        )
    return Keyring(
        keys,
        generation=document.generation,
        digest=verified.digest,
        deployment_id=document.deployment_id,
    )
