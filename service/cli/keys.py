"""``cryptd keys create|rotate|update|delete|cancel-deletion|destroy-due|list|show|usage|
set-min-version``: manage keys directly in the key store (the keyring file, or PostgreSQL with
``--keystore-url``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import orjson

from service.config import DEFAULT_DELETION_WAITING_PERIOD, decode_master_key
from service.crypto.registry import KEY_TYPES
from service.keys.admin import initialise
from service.keys.manager import MIN_AUTO_ROTATE_PERIOD, KeyManager
from service.keys.masterkey import MasterKey
from service.keys.mutations import KeySettings
from service.keys.store import KeyStore
from service.seal import unseal_master_key
from service.stores import open_store


def master_key_from_env(path: str | None = None) -> MasterKey:
    """The master key from --master-key-file, CRYPTD_MASTER_KEY or CRYPTD_MASTER_KEY_FILE."""
    if path:
        return MasterKey(decode_master_key(Path(path).read_text(), path))
    if os.environ.get("CRYPTD_SEAL", "static") != "static":
        return unseal_master_key()
    if value := os.environ.get("CRYPTD_MASTER_KEY"):
        return MasterKey(decode_master_key(value, "CRYPTD_MASTER_KEY"))
    if file := os.environ.get("CRYPTD_MASTER_KEY_FILE"):
        return MasterKey(decode_master_key(Path(file).read_text(), "CRYPTD_MASTER_KEY_FILE"))
    raise ValueError("set CRYPTD_MASTER_KEY or CRYPTD_MASTER_KEY_FILE, or pass --master-key-file")


def store_from_args(args: argparse.Namespace) -> KeyStore:
    """--keystore-url (or $CRYPTD_KEYSTORE_URL) selects PostgreSQL; else --keyring (or
    $CRYPTD_KEYRING_FILE, default keyring.json)."""
    url = args.keystore_url or os.environ.get("CRYPTD_KEYSTORE_URL") or None
    path = Path(args.keyring or os.environ.get("CRYPTD_KEYRING_FILE", "keyring.json"))
    return open_store(url, path)


def waiting_period_from_env() -> int:
    """What the service would use: CRYPTD_DELETION_WAITING_PERIOD, else 7 days (0 with
    CRYPTD_ENV=development)."""
    if value := os.environ.get("CRYPTD_DELETION_WAITING_PERIOD"):
        return int(value)
    return 0 if os.environ.get("CRYPTD_ENV") == "development" else DEFAULT_DELETION_WAITING_PERIOD


def _manager(
    args: argparse.Namespace, *, create: bool = False, waiting_period: int = 0
) -> KeyManager:
    store = store_from_args(args)
    master = master_key_from_env(args.master_key_file)
    if create and store.backend == "file" and store.read() is None:
        initialise(store, master)
        print(f"created empty keyring {store.description}", file=sys.stderr)
    development = os.environ.get("CRYPTD_ENV") == "development"
    manager = KeyManager(
        store,
        master,
        min_auto_rotate_period=1 if development else MIN_AUTO_ROTATE_PERIOD,
        deletion_waiting_period=waiting_period,
    )
    manager.load()
    return manager


_HEX = re.compile(rb"[0-9A-Fa-f\s]+")


def read_material(data: bytes, type_name: str) -> bytes:
    """What ``--import`` reads: PEM or DER for private keys (SM2 also its 64-digit hex scalar),
    hex digits for secret keys (whitespace ignored), or else the raw bytes."""
    key_type = KEY_TYPES[type_name]
    import_key = key_type.import_key
    if import_key is None:
        raise ValueError(f"key type {type_name} does not support import")
    if not key_type.asymmetric and _HEX.fullmatch(data.strip() or b"x"):
        digits = b"".join(data.split())
        if len(digits) % 2:
            raise ValueError("--import: odd number of hex digits")
        data = bytes.fromhex(digits.decode("ascii"))
    return import_key(data)


def _material(args: argparse.Namespace, type_name: str) -> bytes | None:
    if not args.import_file:
        return None
    return read_material(Path(args.import_file).read_bytes(), type_name)


def _print(data: object) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def create(args: argparse.Namespace) -> int:
    manager = _manager(args, create=True)
    key = manager.create(
        args.name,
        args.type,
        deletion_allowed=args.deletion_allowed,
        material=_material(args, args.type),
        derived=args.derived,
        convergent=args.convergent,
        auto_rotate_period=args.auto_rotate_period,
    )
    _print(key.metadata())
    return 0


def rotate(args: argparse.Namespace) -> int:
    manager = _manager(args)
    type_name = manager.keyring.key(args.name).type.name
    _print(manager.rotate(args.name, material=_material(args, type_name)).metadata())
    return 0


def settings_from_args(args: argparse.Namespace) -> KeySettings:
    """The settings ``update`` changes, as the command line gives them (None: unchanged)."""
    return KeySettings(
        min_decryption_version=args.min_decryption_version,
        deletion_allowed=args.deletion_allowed,
        auto_rotate_period=args.auto_rotate_period,
        state=args.state,
        min_encryption_version=args.min_encryption_version,
    )


def update(args: argparse.Namespace) -> int:
    _print(_manager(args).update(args.name, **settings_from_args(args)).metadata())
    return 0


def delete(args: argparse.Namespace) -> int:
    period = waiting_period_from_env() if args.waiting_period is None else args.waiting_period
    pending = _manager(args, waiting_period=period).delete(args.name)
    _print({"deleted": args.name} if pending is None else pending.metadata())
    return 0


def cancel_deletion(args: argparse.Namespace) -> int:
    _print(_manager(args).cancel_deletion(args.name).metadata())
    return 0


def destroy_due(args: argparse.Namespace) -> int:
    """What the service's scheduler does, for a keyring no service writes (a Secret)."""
    _, destroyed = _manager(args).run_due(rotate=False)
    _print({"destroyed": destroyed})
    return 0


def list_keys(args: argparse.Namespace) -> int:
    keyring = _manager(args).keyring
    _print({"keys": [key.metadata() for key in keyring.live()]})
    return 0


def show(args: argparse.Namespace) -> int:
    _print(_manager(args).keyring.key(args.name).describe())
    return 0


def usage(args: argparse.Namespace) -> int:
    """What the usage store holds for every key (or one): the counts every server flushed,
    without what running servers counted in the last flush interval."""
    from service.defaults import default_usage_file
    from service.stores import open_usage_store
    from service.usage.recorder import as_json, tally

    keyring = _manager(args).keyring
    names = [args.name] if args.name else sorted(keyring)
    keys = [keyring.key(name) for name in names]
    url = args.keystore_url or os.environ.get("CRYPTD_KEYSTORE_URL") or None
    keyring_file = Path(args.keyring or os.environ.get("CRYPTD_KEYRING_FILE", "keyring.json"))
    path = args.usage_file or os.environ.get("CRYPTD_USAGE_FILE")
    store = open_usage_store(url, Path(path) if path else default_usage_file(keyring_file))
    try:
        rows = store.read_all()
    finally:
        store.close()
    report = []
    for key in keys:
        mine = [
            (r.version, r.operation, r.count, r.last_used_at)
            for r in rows
            if r.key == key.name and r.key_created == key.created_at
        ]
        counted = tally(key, mine)
        report.append(
            {
                "name": key.name,
                "versions": [
                    {"version": number, **as_json(counted[number])} for number in sorted(counted)
                ],
            }
        )
    _print({"store": store.description, "keys": report})
    return 0


def set_min_version(args: argparse.Namespace) -> int:
    _print(_manager(args).update(args.name, min_decryption_version=args.version).metadata())
    return 0


def store_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--keyring", help="keyring file (default: $CRYPTD_KEYRING_FILE)")
    common.add_argument(
        "--keystore-url", help="PostgreSQL key store (default: $CRYPTD_KEYSTORE_URL)"
    )
    common.add_argument("--master-key-file", help="file holding the base64 master key")
    return common


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("keys", help="manage keys in the key store")
    common = store_options()
    actions = parser.add_subparsers(dest="action", required=True)

    p = actions.add_parser("create", parents=[common], help="create a key (version 1)")
    p.add_argument("name")
    p.add_argument("--type", required=True, choices=sorted(KEY_TYPES))
    p.add_argument("--deletion-allowed", action="store_true")
    p.add_argument(
        "--import",
        dest="import_file",
        metavar="FILE",
        help="import existing key material: secret keys as hex digits (or raw bytes), private "
        "keys as PEM or DER (SM2 also a 64-digit hex scalar)",
    )
    p.add_argument("--derived", action="store_true", help="a key per context (HKDF)")
    p.add_argument(
        "--convergent",
        action="store_true",
        help="deterministic encryption (with --derived; what it reveals: docs/FORMAT.md)",
    )
    p.add_argument("--auto-rotate-period", type=int, default=0, help="seconds (0: off)")
    p.set_defaults(func=create)

    p = actions.add_parser("rotate", parents=[common], help="add a new version")
    p.add_argument("name")
    p.add_argument(
        "--import", dest="import_file", metavar="FILE", help="new version's material (as create)"
    )
    p.set_defaults(func=rotate)

    p = actions.add_parser("update", parents=[common], help="change a key's settings")
    p.add_argument("name")
    p.add_argument("--min-decryption-version", type=int)
    p.add_argument("--deletion-allowed", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--auto-rotate-period", type=int, help="seconds (0: off)")
    p.add_argument(
        "--state", choices=("enabled", "decrypt_only", "disabled"), help="the key's state"
    )
    p.add_argument(
        "--min-encryption-version", type=int, help="lowest version to encrypt with (0: none)"
    )
    p.set_defaults(func=update)

    p = actions.add_parser(
        "delete",
        parents=[common],
        help="delete a key that allows it: at once, or pending until the waiting period ends",
    )
    p.add_argument("name")
    p.add_argument(
        "--waiting-period",
        type=int,
        help="seconds (default: $CRYPTD_DELETION_WAITING_PERIOD, 7 days; 0 in development)",
    )
    p.set_defaults(func=delete)

    p = actions.add_parser(
        "cancel-deletion", parents=[common], help="undo a scheduled deletion before its date"
    )
    p.add_argument("name")
    p.set_defaults(func=cancel_deletion)

    p = actions.add_parser(
        "destroy-due",
        parents=[common],
        help="destroy the keys whose deletion date has passed (the service does it itself "
        "where it may write the store)",
    )
    p.set_defaults(func=destroy_due)

    p = actions.add_parser("list", parents=[common], help="list keys")
    p.set_defaults(func=list_keys)

    p = actions.add_parser("show", parents=[common], help="metadata and public keys")
    p.add_argument("name")
    p.set_defaults(func=show)

    p = actions.add_parser(
        "usage", parents=[common], help="operation counts and last use per key version"
    )
    p.add_argument("name", nargs="?", help="one key (default: every key)")
    p.add_argument(
        "--usage-file",
        help="the file key store's usage file (default: $CRYPTD_USAGE_FILE, "
        "else beside the keyring)",
    )
    p.set_defaults(func=usage)

    p = actions.add_parser("set-min-version", parents=[common], help="set min_decryption_version")
    p.add_argument("name")
    p.add_argument("version", type=int)
    p.set_defaults(func=set_min_version)
