"""Response bodies, as pydantic models: they exist to describe the wire (the OpenAPI document
and the tests that hold answers to it). The routes build their answers as plain dicts on the
hot path; the schemas here say exactly what those dicts hold."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from service.api.schemas import Base64, KeyName, KeyTypeName, Token

Version = Annotated[int, Field(ge=1, description="Key version (1, 2, ...).")]
Timestamp = Annotated[
    str,
    Field(
        json_schema_extra={"format": "date-time", "pattern": "Z$"},
        description="RFC 3339, UTC, with a 'Z' suffix.",
    ),
]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EncryptResponse(_Answer):
    ciphertext: Token
    key_version: Version


class DecryptResponse(_Answer):
    plaintext: Base64
    key_version: Version


class SignResponse(_Answer):
    signature: Base64
    key_version: Version


class VerifyResponse(_Answer):
    valid: bool = Field(description="false for any signature bytes that do not verify")


class DatakeyResponse(_Answer):
    plaintext: Base64 | None = Field(
        default=None,
        description="The data key itself: use it, then forget it (absent with plaintext: false).",
    )
    ciphertext: Token = Field(description="The same data key wrapped by the named key.")
    key_version: Version


class HmacResponse(_Answer):
    mac: Token = Field(description="The tag as a token: cryptd:v<version>:<base64url tag>.")
    key_version: Version


class EncapsulateResponse(_Answer):
    ciphertext: Base64 = Field(
        description="The KEM ciphertext (FIPS 203 bytes; X-Wing: ct_ML-KEM || ct_X25519)."
    )
    shared_secret: Base64 = Field(description="The 32-byte shared secret.")
    key_version: Version


class DecapsulateResponse(_Answer):
    shared_secret: Base64 = Field(
        description="The 32-byte shared secret. A ciphertext made for another key gives another "
        "secret (implicit rejection), never an error."
    )
    key_version: Version


class RandomResponse(_Answer):
    random: Base64


class WrappingKeyResponse(_Answer):
    public_key: str = Field(description="SubjectPublicKeyInfo PEM of the import wrapping key.")
    type: Literal["rsa-4096"]


class BackupResponse(_Answer):
    backup: Base64 = Field(
        description="One key, every version and its metadata, encrypted and authenticated "
        "under the master key (docs/FORMAT.md, section 10)."
    )


class ErrorDetail(_Answer):
    code: str = Field(description="Stable error code (the contract's table).")
    message: str = Field(description="Safe to show: never key material, plaintext or secrets.")


class Error(_Answer):
    """Every error, whatever the status."""

    error: ErrorDetail


KeyState = Annotated[
    Literal["enabled", "decrypt_only", "disabled", "pending_deletion"],
    Field(
        description="enabled; decrypt_only (decrypt, verify, rewrap from it); disabled "
        "(everything refused); pending_deletion (everything refused until deletion_date, "
        "cancel-deletion restores the state it had)."
    ),
]
MinEncryptionVersion = Annotated[
    int, Field(ge=0, description="Lowest version new encryptions and signatures use; 0: none.")
]


class KeySummary(_Answer):
    name: KeyName
    type: KeyTypeName
    latest_version: Version
    min_decryption_version: Version
    min_encryption_version: MinEncryptionVersion
    state: KeyState


class KeyList(_Answer):
    keys: list[KeySummary]


class KeyMetadata(_Answer):
    name: KeyName
    type: KeyTypeName
    created_at: Timestamp
    latest_version: Version
    min_decryption_version: Version
    deletion_allowed: bool
    derived: bool = Field(description="Every operation takes a context (HKDF-derived keys).")
    convergent: bool = Field(description="Same plaintext, aad and context: same ciphertext.")
    auto_rotate_period: int = Field(
        ge=0, description="Seconds between automatic rotations (0: none)."
    )
    state: KeyState
    min_encryption_version: MinEncryptionVersion
    deletion_date: Timestamp | None = Field(
        default=None,
        description="While pending_deletion: when the key is destroyed (never served after).",
    )


Count = Annotated[int, Field(ge=0)]


class OperationCounts(_Answer):
    """Successful operations per kind (a batch item counts once). ``rewrap`` counts on both
    versions it touches: ``rewrap_from`` where it decrypted, ``rewrap_to`` where it encrypted."""

    encrypt: Count
    decrypt: Count
    sign: Count
    verify: Count
    hmac: Count
    datakey: Count
    rewrap_from: Count
    rewrap_to: Count
    encapsulate: Count
    decapsulate: Count


class VersionUsage(_Answer):
    """Totals across every worker and replica sharing the store, flushed every
    CRYPTD_USAGE_FLUSH_INTERVAL seconds, plus the answering worker's counts not yet flushed."""

    operations: OperationCounts
    total: Count
    last_used_at: Timestamp | None = Field(
        description="Latest successful operation (null: never), at most one flush interval late.",
    )


class KeyVersionInfo(_Answer):
    version: Version
    created_at: Timestamp
    usage: VersionUsage | None = Field(
        description="Operation counts and last use; null while the usage store is unreadable."
    )
    public_key_pem: str | None = Field(
        default=None, description="SubjectPublicKeyInfo PEM (asymmetric keys only)."
    )
    public_key_raw: str | None = Field(
        default=None,
        description="Customary raw encoding, hex (SM2: 04||x||y; ML-KEM and X-Wing: the HPKE "
        "public key, X-Wing's pk_ML-KEM||pk_X25519).",
    )


class KeyDescription(KeyMetadata):
    versions: list[KeyVersionInfo]


class Health(_Answer):
    status: Literal["ok"]


class Readiness(_Answer):
    status: Literal["ready", "degraded", "not_ready"]
    reasons: list[str] = Field(
        description="Why the service is not ready, or serves degraded (empty when ready); "
        "e.g. the replay store's refusal window after a start, restart or failover."
    )
    checks: dict[str, dict[str, Any]] = Field(
        description="One entry per check (keyring, pool, replay_store, ...), each with 'ok'."
    )


class MasterKeyRotation(_Answer):
    seal: Literal["static", "pkcs11", "transit"] = Field(
        description="Where the new master key is kept."
    )
    previous_master_key_id: str = Field(description="Public fingerprint of the retired key.")
    master_key_id: str = Field(description="Public fingerprint of the new master key.")
    keys: int = Field(description="Keys rewrapped (internal ones included).")
    versions: int = Field(description="Key versions rewrapped.")
    generation: int = Field(description="The keyring generation written under the new key.")
    seconds: float = Field(description="How long the rotation took.")
    interrupted_rotation: Literal["finished", "rolled back"] | None = Field(
        default=None,
        description="An earlier rotation a crash interrupted, settled first (absent: none).",
    )


class SealStatus(_Answer):
    sealed: bool = Field(description="True until the master key is in this server's memory.")
    threshold: int = Field(description="How many unseal shares it takes (1: the seal's own key).")
    progress: int = Field(description="Valid shares received so far while sealed.")
    type: Literal["static", "pkcs11", "shamir", "transit"] = Field(
        description="The seal (CRYPTD_SEAL)."
    )
    available: bool = Field(
        description="Whether the seal's backing (the PKCS#11 token, the Transit service) answers; "
        "false: crypto "
        "keeps serving from memory and /readyz is degraded."
    )
    refused: int = Field(
        description="Shares refused since this worker started (malformed, altered, of another "
        "split, repeated); a refusal leaves the progress as it was."
    )
    reason: str | None = Field(default=None, description="Why the seal is unavailable.")


__all__ = [
    "BackupResponse",
    "DatakeyResponse",
    "DecryptResponse",
    "EncryptResponse",
    "Error",
    "ErrorDetail",
    "Health",
    "HmacResponse",
    "KeyDescription",
    "KeyList",
    "KeyMetadata",
    "KeySummary",
    "KeyVersionInfo",
    "OperationCounts",
    "RandomResponse",
    "Readiness",
    "SealStatus",
    "SignResponse",
    "VerifyResponse",
    "VersionUsage",
    "WrappingKeyResponse",
]


class Approval(_Answer):
    """Dual control (CRYPTD_APPROVALS): a request held for a second admin client."""

    approval_id: str = Field(pattern="^[0-9a-f]{32}$", description="Send it as X-Approval-ID.")
    operation: Literal["delete", "backup", "import", "restore", "enable", "rotate-master-key"]
    key: KeyName | None = Field(description="The key it concerns (null: none, as a rotation).")
    expires_at: Timestamp = Field(description="Approve and carry it out before this time.")
    state: Literal["pending", "approved", "rejected", "used", "expired"]
    method: str = Field(description="The request it is bound to (and its body's digest).")
    path: str
    requested_by: str = Field(description="The only client that may carry it out.")
    requested_at: Timestamp
    decided_by: str | None = Field(description="Who approved or rejected it.")
    decided_at: Timestamp | None
    used_at: Timestamp | None
    details: dict[str, str] | None = None


class DeletionAccepted(RootModel[KeyMetadata | Approval]):
    """202 to DELETE: the key scheduled for deletion, or the request held for approval."""
