"""``cryptd audit init|verify|public-key|hash``: the trail's keys; prove a trail; hand an
auditor what it needs.

``init`` creates the keyring's internal audit keys (the service makes them on first use; a
read-only keyring needs them made here, once).

``verify FILE…`` checks the hash chain of every stream across rotated and per-worker files
and every signed checkpoint (service/audit/verify.py); exit 0 only when all of it holds, 1
naming the first bad record, 2 when it cannot check (no signing key). The checkpoint keys come
from the keyring (master key and store as for ``cryptd keys``) or, for an auditor without the
master key, from ``--public-key`` files that ``cryptd audit public-key`` wrote.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import orjson

from service.audit import checkpoint, redact
from service.audit.verify import verify
from service.cli.keys import master_key_from_env, store_from_args, store_options
from service.keys.keyring import Key
from service.keys.manager import KeyManager


def _internal(args: argparse.Namespace, name: str) -> Key:
    manager = KeyManager(store_from_args(args), master_key_from_env(args.master_key_file))
    manager.load()
    key = manager.keyring.internal.get(name)
    if key is None:
        raise ValueError(f"the keyring holds no {name} (the service makes it on first use)")
    return key


def _keyring_public_keys(args: argparse.Namespace) -> dict[int, checkpoint.Verifier]:
    key = _internal(args, checkpoint.SIGNING_KEY)
    found: dict[int, checkpoint.Verifier] = {}
    for number, version in key.versions.items():
        pem = version.handle.public_key_pem()
        if key.type.name not in checkpoint.SIGNING_KEY_TYPES or pem is None:
            raise ValueError(f"version {number} of {checkpoint.SIGNING_KEY} is not Ed25519 or SM2")
        found[number] = checkpoint.verifier_from_pem(pem)
    return found


def _file_public_keys(paths: list[str]) -> dict[int, checkpoint.Verifier]:
    found: dict[int, checkpoint.Verifier] = {}
    for path in paths:
        document = orjson.loads(Path(path).read_bytes())
        for number, pem in document["versions"].items():
            try:
                found[int(number)] = checkpoint.verifier_from_pem(pem)
            except ValueError as exc:
                raise ValueError(f"{path}: version {number}: {exc}") from None
    return found


def init_command(args: argparse.Namespace) -> int:
    manager = KeyManager(store_from_args(args), master_key_from_env(args.master_key_file))
    manager.load()
    for name, type_name in (
        (checkpoint.SIGNING_KEY, args.signing_key_type),
        (redact.HMAC_KEY, redact.HMAC_KEY_TYPE),
    ):
        found = name in manager.keyring.internal
        manager.ensure_internal_key(name, type_name)
        print(f"{name}: {'present' if found else 'created'}")
    return 0


def verify_command(args: argparse.Namespace) -> int:
    try:
        keys = _file_public_keys(args.public_key) if args.public_key else _keyring_public_keys(args)
    except (ValueError, OSError, KeyError, orjson.JSONDecodeError) as exc:
        print(f"cryptd audit verify: cannot check checkpoints: {exc}", file=sys.stderr)
        return 2
    report = verify(args.files, keys, partial=args.partial, sealed=args.sealed)
    if args.json:
        sys.stdout.write(
            orjson.dumps(
                {
                    "ok": report.ok,
                    "error": report.error,
                    "streams": [vars(stream) for stream in report.streams],
                },
                option=orjson.OPT_INDENT_2,
            ).decode()
            + "\n"
        )
    else:
        for stream in report.streams:
            print(
                f"stream {stream.stream}: {len(stream.files)} file(s), records"
                f" {stream.first_seq}..{stream.last_seq}, {stream.checkpoints} checkpoint(s),"
                f" {stream.unsigned_tail} line(s) after the last checkpoint"
            )
        print("audit trail verified" if report.ok else f"FAILED: {report.error}")
    return 0 if report.ok else 1


def public_key_command(args: argparse.Namespace) -> int:
    key = _internal(args, checkpoint.SIGNING_KEY)
    versions = {str(n): v.handle.public_key_pem() or "" for n, v in key.versions.items()}
    sys.stdout.write(
        orjson.dumps({"key": checkpoint.SIGNING_KEY, "versions": versions}).decode() + "\n"
    )
    return 0


def hash_command(args: argparse.Namespace) -> int:
    """The form a value takes in the audit records, so an auditor can search for it."""
    handle = _internal(args, redact.HMAC_KEY).version(1).handle
    value = args.value.encode()
    print(redact.hashed(handle.mac, value))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("audit", help="verify the audit trail")
    actions = parser.add_subparsers(dest="action", required=True)
    common = store_options()
    init = actions.add_parser(
        "init", parents=[common], help="create the keyring's audit signing and HMAC keys"
    )
    init.add_argument(
        "--signing-key-type",
        choices=checkpoint.SIGNING_KEY_TYPES,
        default=os.environ.get("CRYPTD_AUDIT_SIGNING_KEY_TYPE", checkpoint.SIGNING_KEY_TYPE),
        help="the checkpoint signing key's type when it is made here (default "
        "$CRYPTD_AUDIT_SIGNING_KEY_TYPE, else ed25519); an existing key keeps its type",
    )
    init.set_defaults(func=init_command)
    check = actions.add_parser(
        "verify",
        parents=[common],
        help="prove the hash chain and every signed checkpoint of audit files",
    )
    check.add_argument("files", nargs="+", help="every file of the trail (rotated, per worker)")
    check.add_argument(
        "--public-key",
        action="append",
        help="checkpoint keys from this file (cryptd audit public-key) instead of the keyring",
    )
    check.add_argument(
        "--partial", action="store_true", help="streams may start after seq 1 (archived files)"
    )
    check.add_argument(
        "--sealed",
        action="store_true",
        help="every stream must end with a checkpoint (after a clean stop or a rotation)",
    )
    check.add_argument("--json", action="store_true", help="the report as JSON")
    check.set_defaults(func=verify_command)
    public = actions.add_parser(
        "public-key", parents=[common], help="print the checkpoint signing key's public keys"
    )
    public.set_defaults(func=public_key_command)
    digest = actions.add_parser(
        "hash", parents=[common], help="print a value as the audit records hold it (HMAC)"
    )
    digest.add_argument("value", help="an AAD, context, signer id or key name, as sent")
    digest.set_defaults(func=hash_command)
