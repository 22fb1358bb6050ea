"""The key management operations of both clients, each written once: list, read, create,
rotate, update, delete (and cancel it), bring your own key (import, wrapped here under the
server's wrapping key), backup and restore; and the health check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from cryptd_client._base import BaseClient, Plan
from cryptd_client._methods import operation
from cryptd_client._wire import Binary, _b64, _body, _Call, _key_path
from cryptd_client.results import KeyMetadata

_UPDATABLE: Final = (
    "min_decryption_version",
    "deletion_allowed",
    "auto_rotate_period",
    "state",
    "min_encryption_version",
)


def _wrapped(public_pem: str, material: Binary) -> str:
    """``material`` wrapped for import, here, so it never travels in the clear: RSA-OAEP
    (SHA-256) of a fresh AES-256 key under the server's wrapping key, then AES key wrap with
    padding (RFC 5649) of the material - OpenBao's and AWS KMS's BYOK wrapping. Needs the
    ``cryptography`` package (the ``import`` extra), which the rest of this client does not."""
    try:
        import os

        from cryptography.hazmat.primitives import hashes, keywrap, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
    except ImportError as exc:  # pragma: no cover - the server's tests always have it
        raise ImportError(
            "importing key material needs 'cryptography': pip install 'cryptd-client[import]'"
        ) from exc
    if not isinstance(material, Binary):
        raise TypeError(f"material must be bytes, not {type(material).__name__}")
    public = serialization.load_pem_public_key(public_pem.encode("ascii"))
    if not isinstance(public, rsa.RSAPublicKey):
        raise ValueError("the wrapping key is not an RSA public key")
    ephemeral = os.urandom(32)
    oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
    wrapped = public.encrypt(ephemeral, oaep) + keywrap.aes_key_wrap_with_padding(
        ephemeral, bytes(material)
    )
    return _b64(wrapped)


def _key_call(
    method: str, key: str, suffix: str = "", body: Mapping[str, Any] | None = None
) -> _Call[KeyMetadata]:
    path = _key_path("keys", key) + suffix
    return _Call(method, path, body, KeyMetadata.from_json, idempotent=method == "GET")


def _wrapping_key() -> _Call[str]:
    return _Call("GET", "/v1/keys/wrapping-key", None, lambda data: str(data["public_key"]))


def _deleted(data: Mapping[str, Any] | None) -> KeyMetadata | None:
    # 204: deleted at once (no body); 202: scheduled, the pending key's metadata.
    return None if data is None else KeyMetadata.from_json(data)


class KeyEndpoints(BaseClient):
    """Key management (most of it admin only) and the health check."""

    @operation
    def list_keys(self) -> _Call[list[KeyMetadata]]:
        def parse(data: Mapping[str, Any]) -> list[KeyMetadata]:
            return [KeyMetadata.from_json(k) for k in data["keys"]]

        return _Call("GET", "/v1/keys", None, parse)

    @operation
    def get_key(self, key: str) -> _Call[KeyMetadata]:
        return _key_call("GET", key)

    @operation
    def create_key(
        self,
        key: str,
        type: str,
        deletion_allowed: bool = False,
        *,
        derived: bool = False,
        convergent: bool = False,
    ) -> _Call[KeyMetadata]:
        body: dict[str, Any] = {"type": type, "deletion_allowed": deletion_allowed}
        if derived:
            body["derived"] = True
        if convergent:
            body["convergent"] = True
        return _key_call("POST", key, body=body)

    @operation
    def rotate_key(self, key: str) -> _Call[KeyMetadata]:
        return _key_call("POST", key, "/rotate")

    @operation
    def update_key(
        self,
        key: str,
        *,
        min_decryption_version: int | None = None,
        deletion_allowed: bool | None = None,
        auto_rotate_period: int | None = None,
        state: str | None = None,
        min_encryption_version: int | None = None,
    ) -> _Call[KeyMetadata]:
        """Change a key's settings (admin); only the arguments given are sent. ``state``:
        ``enabled``, ``decrypt_only`` or ``disabled``; ``min_encryption_version``: 0 (none)
        or a version from ``min_decryption_version`` to the latest."""
        body = _body(
            min_decryption_version=min_decryption_version,
            deletion_allowed=deletion_allowed,
            auto_rotate_period=auto_rotate_period,
            state=state,
            min_encryption_version=min_encryption_version,
        )
        if not body:
            raise ValueError("give at least one of " + ", ".join(_UPDATABLE))
        return _key_call("PATCH", key, body=body)

    @operation
    def delete_key(self, key: str) -> _Call[KeyMetadata | None]:
        """Delete a key that allows deletion (admin). None: deleted (204). With a waiting
        period on the server (202): the key's metadata, ``state`` ``pending_deletion`` and its
        ``deletion_date``; :meth:`cancel_deletion` undoes it until then."""
        return _Call("DELETE", _key_path("keys", key), None, _deleted, idempotent=False)

    @operation
    def cancel_deletion(self, key: str) -> _Call[KeyMetadata]:
        """Undo a scheduled deletion (admin): the key gets back the state it had."""
        return _key_call("POST", key, "/cancel-deletion")

    @operation
    def wrapping_key(self) -> _Call[str]:
        """The PEM of the RSA-4096 key that wraps imported key material (admin)."""
        return _wrapping_key()

    @operation
    def import_key(
        self,
        key: str,
        type: str,
        material: bytes,
        *,
        deletion_allowed: bool = False,
        derived: bool = False,
        convergent: bool = False,
    ) -> Plan[KeyMetadata]:
        """Create ``key`` from ``material`` (raw bytes for secret keys, PKCS#8 DER for private
        keys), wrapped here under the server's wrapping key (admin; needs ``cryptography``)."""
        public_pem: str = yield _wrapping_key()
        body = _body(
            type=type,
            ciphertext=_wrapped(public_pem, material),
            deletion_allowed=deletion_allowed,
            derived=derived,
            convergent=convergent,
        )
        imported: KeyMetadata = yield _key_call("POST", key, "/import", body)
        return imported

    @operation
    def import_key_version(self, key: str, material: bytes) -> Plan[KeyMetadata]:
        """Add a version to ``key`` from ``material``, wrapped here (admin)."""
        public_pem: str = yield _wrapping_key()
        body = _body(ciphertext=_wrapped(public_pem, material))
        imported: KeyMetadata = yield _key_call("POST", key, "/import-version", body)
        return imported

    @operation
    def backup_key(self, key: str) -> _Call[str]:
        """One opaque blob (base64 text): every version and the metadata, under the master key
        (admin)."""
        path = _key_path("keys", key) + "/backup"
        return _Call("GET", path, None, lambda data: str(data["backup"]))

    @operation
    def restore_key(self, key: str, backup: str) -> _Call[KeyMetadata]:
        """Restore what :meth:`backup_key` gave into a cryptd holding the same master key."""
        if not isinstance(backup, str):
            raise TypeError(
                f"backup is the text backup_key gave (str), not {type(backup).__name__}"
            )
        return _key_call("POST", key, "/restore", {"backup": backup})

    @operation
    def healthz(self) -> _Call[dict[str, Any]]:
        return _Call("GET", "/healthz", None, lambda data: dict(data or {}), signed=False)
