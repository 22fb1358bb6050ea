"""``cryptd keystore init|copy|show|schema``: create, copy and check key stores.

``init`` and ``copy`` create the PostgreSQL schema: run them with a role that may create
tables; the service itself needs only SELECT, INSERT, UPDATE and DELETE on them (``schema
--grant-to ROLE`` prints the statements)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from service.cli.keys import master_key_from_env, store_from_args, store_options
from service.keys.admin import copy_keyring, initialise
from service.keys.manager import KeyManager
from service.keys.store import KeyStore
from service.stores import open_store


def _location(text: str) -> KeyStore:
    """A postgresql:// URL or a keyring file path."""
    if text.startswith(("postgresql://", "postgres://")):
        return open_store(text, Path())
    return open_store(None, Path(text))


def _print(data: object) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def init(args: argparse.Namespace) -> int:
    store = store_from_args(args)
    document = initialise(store, master_key_from_env(args.master_key_file))
    _print(
        {
            "store": store.description,
            "deployment_id": document.deployment_id,
            "generation": document.generation,
        }
    )
    return 0


def copy(args: argparse.Namespace) -> int:
    source, target = _location(args.source), _location(args.target)
    report = copy_keyring(source, target, master_key_from_env(args.master_key_file))
    _print(
        {
            "source": source.description,
            "target": target.description,
            "keys": report.keys,
            "versions": report.versions,
            "deployment_id": report.deployment_id,
            "generation": report.generation,
            "verified": True,
        }
    )
    return 0


def show(args: argparse.Namespace) -> int:
    """Load the whole keyring as the service would (every blob unwraps) and summarise it."""
    store = store_from_args(args)
    keyring = KeyManager(store, master_key_from_env(args.master_key_file)).load()
    _print(
        {
            "store": store.description,
            "deployment_id": keyring.deployment_id,
            "generation": keyring.generation,
            "digest": keyring.digest,
            "keys": len(keyring),
            "versions": sum(len(key.versions) for key in keyring.values()),
        }
    )
    return 0


def schema(args: argparse.Namespace) -> int:
    from service.keys.pgstore import SCHEMA, TABLES

    lines = [statement.strip() + ";" for statement in SCHEMA]
    if args.grant_to:
        role = args.grant_to
        if not role.replace("_", "").isalnum():
            raise ValueError("--grant-to takes a plain role name")
        lines.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {', '.join(TABLES)} TO {role};")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("keystore", help="create, copy and check key stores")
    common = store_options()
    actions = parser.add_subparsers(dest="action", required=True)

    p = actions.add_parser(
        "init", parents=[common], help="create the schema (PostgreSQL) and an empty keyring"
    )
    p.set_defaults(func=init)

    p = actions.add_parser(
        "copy",
        help="copy a keyring into an empty store, material still wrapped, and verify the copy",
    )
    p.add_argument("source", help="keyring file or postgresql:// URL")
    p.add_argument("target", help="keyring file or postgresql:// URL (must hold no keyring)")
    p.add_argument("--master-key-file", help="file holding the base64 master key")
    p.set_defaults(func=copy)

    p = actions.add_parser("show", parents=[common], help="verify and summarise the keyring")
    p.set_defaults(func=show)

    p = actions.add_parser("schema", help="print the PostgreSQL schema (and grants)")
    p.add_argument("--grant-to", help="role the service connects as")
    p.set_defaults(func=schema)
